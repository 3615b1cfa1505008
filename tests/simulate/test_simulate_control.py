"""The simulated host's control actions: one table, documented; hardware faults kept across a daemon
restart until a simulated reboot; ``gpumon simulate`` writing the control file; ``once`` and ``check``
using the simulated host of a given state directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpumon.simulate import HOSTS, Simulation, control
from gpumon.simulate.actions import ACTIONS, check, example_args, parse_assignments
from tests.conftest import REPO, clean_env

H100 = "nd-h100-v5"
DEFAULT_HOST = f"/var/lib/gpumon/simulate/{H100}"


def docs() -> str:
    with open(os.path.join(REPO, "docs", "simulate.md"), encoding="utf-8") as fh:
        return fh.read()


def test_every_action_and_profile_is_documented_with_its_example() -> None:
    page = docs()
    for action in ACTIONS.values():
        assert f"| `{action.name}` |" in page, action.name
        assert json.dumps(action.example) in page, action.name  # the file to drop, verbatim
        assert f"`gpumon simulate {example_args(action)}`" in page, action.name
        check(action.example, gpu=True, ib=True)  # every example is a valid command
    for name, host in HOSTS.items():
        assert f"| `{name}` |" in page and f"`{host.vm_size}`" in page, name
    assert "simulate/<profile>/" in page and "`control/`" in page


def test_the_docstring_names_the_control_directory_the_daemon_uses(tmp_path) -> None:
    import gpumon.simulate
    from gpumon.cli import build_parser, load_config
    from gpumon.daemon import simulation_dir

    assert "<state_dir>/simulate/<profile>/" in (gpumon.simulate.__doc__ or "")
    config = load_config(build_parser().parse_args(["run", "--simulate", H100, "--state-dir", str(tmp_path)]))
    assert simulation_dir(config) == str(tmp_path / "simulate" / H100)


def lost(sim: Simulation, gpu: int) -> bool:
    nvml = sim.nvml
    nvml.nvmlInit()
    try:
        nvml.nvmlDeviceGetHandleByIndex(gpu)
    except nvml.NVMLError as exc:
        return exc.value == nvml.NVML_ERROR_GPU_IS_LOST
    finally:
        nvml.nvmlShutdown()
    return False


def port_state(sim: Simulation, device: str) -> str:
    with open(os.path.join(sim.sysfs_root, "class", "infiniband", device, "ports", "1", "state"),
              encoding="utf-8") as fh:
        return fh.read().strip()


def test_hardware_faults_survive_a_daemon_restart_until_a_reboot(tmp_path) -> None:
    home = str(tmp_path / "simulate" / H100)
    first = Simulation(H100, home)
    boot = first.boot_id
    first.apply({"action": "gpu_lost", "gpu": 2})
    first.apply({"action": "port_down", "device": "mlx5_ib3", "port": 1})             # held: kept
    first.apply({"action": "port_down", "device": "mlx5_ib4", "port": 1, "seconds": 30})  # timed: not kept
    first.apply({"action": "fabric", "gpu": 1, "status": "success"})
    first.apply({"action": "flap", "device": "mlx5_ib0"})                               # an event: not kept
    first.stop()

    again = Simulation(H100, home)  # the daemon restarted: the same hardware
    assert again.boot_id == boot
    assert lost(again, 2) and not lost(again, 1)
    assert port_state(again, "mlx5_ib3") == "1: DOWN" and port_state(again, "mlx5_ib4") == "4: ACTIVE"
    assert [c["action"] for c in again.kept] == ["gpu_lost", "port_down", "fabric"]
    again.apply({"action": "port_up", "device": "mlx5_ib3", "port": 1})
    assert [c["action"] for c in again.kept] == ["gpu_lost", "fabric"]
    control(home, {"action": "reboot"})
    again.step(0.0)
    assert again.boot_id != boot and not lost(again, 2)
    again.stop()

    after = Simulation(H100, home)
    assert after.boot_id == again.boot_id and after.kept == [] and not lost(after, 2)
    with open(os.path.join(home, "boot_id"), encoding="utf-8") as fh:
        assert fh.read().strip() == after.boot_id
    after.stop()


def test_a_restarted_daemon_finds_the_gpu_lost_and_no_second_xid_79(tmp_path) -> None:
    from tests.fakes.simulated_host import SimulatedHost

    before = SimulatedHost(str(tmp_path))
    before.snapshot()
    before.sim.apply({"action": "xid", "gpu": 3, "xid": 79})
    before.close()
    before.sim.stop()
    after = SimulatedHost(str(tmp_path))  # the daemon restarted on the same state directory
    try:
        for _ in range(3):  # the XID thread has had its chance to deliver anything pending
            snap = after.snapshot()
        lost_now = {s.label("gpu"): s.value for s in snap.family("gpumon_gpu_lost").samples}
        xids = snap.family("gpumon_gpu_xid_errors_total")
        assert lost_now["3"] == 1.0 and sum(lost_now.values()) == 1.0
        assert not [s for s in (xids.samples if xids else ()) if s.label("xid") == "79" and s.value > 0]
    finally:
        after.close()
        after.sim.stop()


@pytest.mark.parametrize("command, error", [
    ({"action": "explode"}, "unknown action 'explode'"),
    ({"action": "xid", "gpu": 1}, "xid needs xid"),
    ({"action": "gpu_lost", "gpu": 1, "colour": "red"}, "gpu_lost takes no colour"),
])
def test_a_bad_command_is_refused_with_what_is_wrong(command, error) -> None:
    with pytest.raises(ValueError, match=error):
        check(command, gpu=True, ib=True)


def test_a_host_without_the_hardware_refuses_and_logs_a_bad_file(tmp_path, caplog) -> None:
    with pytest.raises(ValueError, match="needs a host with InfiniBand"):
        check({"action": "flap", "device": "mlx5_ib0"}, gpu=True, ib=False)
    sim = Simulation("nv-a10-v5", str(tmp_path))
    control(str(tmp_path), {"action": "gpu_lost", "gpu": 5})
    sim.step(0.0)
    assert "no GPU 5 (this host has 1)" in caplog.text and sim.kept == []
    assert os.listdir(sim.control_dir) == []


def test_key_value_arguments_become_the_command() -> None:
    assert parse_assignments("fabric", ["gpu=1", "health.route_unhealthy=true", "state=in_progress"]) == {
        "action": "fabric", "gpu": 1, "health": {"route_unhealthy": "true"}, "state": "in_progress"}
    assert parse_assignments("port_down", ["device=mlx5_ib0", "seconds=2.5"])["seconds"] == 2.5
    with pytest.raises(ValueError, match="not key=value"):
        parse_assignments("flap", ["mlx5_ib0"])


def gpumon(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumon", *args], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=60)


def gpu_lost_values(output: str) -> dict[str, float]:
    doc = json.loads(output)
    fam = next(m for m in doc["metrics"] if m["name"] == "gpumon_gpu_lost")
    return {s["labels"]["gpu"]: s["value"] for s in fam["samples"]}


def test_gpumon_simulate_then_once_with_the_state_dir_sees_the_fault_until_reboot(tmp_path) -> None:
    state = str(tmp_path)
    wrote = gpumon("simulate", "gpu_lost", "gpu=2", "--simulate", H100, "--state-dir", state)
    assert wrote.returncode == 0, wrote.stderr
    path = wrote.stdout.split("wrote ", 1)[1].strip()
    assert path.startswith(os.path.join(state, "simulate", H100, "control") + os.sep)
    with open(path, encoding="utf-8") as fh:
        assert json.load(fh) == {"action": "gpu_lost", "gpu": 2}

    checked = gpumon("check", "--simulate", H100, "--state-dir", state, "--sinks", "")
    assert os.path.exists(path), checked.stdout + checked.stderr  # check looks, it takes nothing

    once = gpumon("once", "--simulate", H100, "--state-dir", state, "--format", "json", "--collectors", "nvml",
                  )
    assert gpu_lost_values(once.stdout)["2"] == 1.0, once.stderr
    assert not os.path.exists(path)
    again = gpumon("once", "--simulate", H100, "--state-dir", state, "--format", "json", "--collectors", "nvml",
                   )
    assert gpu_lost_values(again.stdout)["2"] == 1.0  # kept: still lost

    # no profile named: the one simulated host under the state directory
    reboot = gpumon("simulate", "reboot", "--state-dir", state)
    assert reboot.returncode == 0, reboot.stderr
    fixed = gpumon("once", "--simulate", H100, "--state-dir", state, "--format", "json", "--collectors", "nvml",
                   )
    assert set(gpu_lost_values(fixed.stdout).values()) == {0.0}


def test_once_without_a_state_dir_still_uses_a_temporary_host(tmp_path) -> None:
    existed = os.path.exists(DEFAULT_HOST)
    result = subprocess.run([sys.executable, "-m", "gpumon", "once", "--simulate", H100, "--collectors", "nvml",
                             "--format", "json"], cwd=str(tmp_path), env=clean_env(),
                            capture_output=True, text=True, timeout=60)
    assert set(gpu_lost_values(result.stdout).values()) == {0.0}, result.stderr
    assert os.path.exists(DEFAULT_HOST) == existed  # nothing left in the default state directory


@pytest.mark.parametrize("args, error", [
    (["simulate", "explode", "--simulate", H100], "unknown action 'explode'"),
    (["simulate", "flap", "device=mlx5_ib0", "--simulate", "nv-a10-v5"], "needs a host with InfiniBand"),
    (["simulate", "gpu_lost", "gpu=1"], "which simulated host? give --simulate PROFILE"),
    (["simulate", "reboot", "--simulate", "nd-h900"], "unknown simulation profile 'nd-h900'"),
])
def test_gpumon_simulate_refuses_with_exit_2(tmp_path, args, error) -> None:
    result = gpumon(*args, "--state-dir", str(tmp_path))
    assert result.returncode == 2 and error in result.stderr, result.stderr
    assert not os.path.exists(tmp_path / "simulate") or not any(
        os.listdir(tmp_path / "simulate" / p / "control") for p in os.listdir(tmp_path / "simulate"))


def test_gpumon_simulate_wait_says_when_no_daemon_takes_the_file(tmp_path) -> None:
    result = gpumon("simulate", "flap", "device=mlx5_ib0", "--simulate", H100, "--state-dir", str(tmp_path),
                    "--wait", "0.2")
    assert result.returncode == 1 and "nothing took it in 0.2 s" in result.stderr, result.stderr


def mig_slots(sim: Simulation, gpu: int) -> int:
    nvml = sim.nvml
    nvml.nvmlInit()
    try:
        return int(nvml.nvmlDeviceGetMaxMigDeviceCount(nvml.nvmlDeviceGetHandleByIndex(gpu)))
    finally:
        nvml.nvmlShutdown()


def test_mig_holds_across_a_daemon_restart_until_off_or_a_reboot(tmp_path) -> None:
    home = str(tmp_path / "simulate" / H100)
    first = Simulation(H100, home)
    first.apply({"action": "mig", "gpu": 1, "instances": 2})
    first.apply({"action": "mig", "gpu": 1, "instances": 3})   # a new layout replaces the kept one
    first.stop()
    again = Simulation(H100, home)
    assert [c for c in again.kept if c["action"] == "mig"] == [{"action": "mig", "gpu": 1, "instances": 3}]
    assert mig_slots(again, 1) > 0
    with pytest.raises(ValueError, match="instances is 0 to 7"):
        again.apply({"action": "mig", "gpu": 1, "instances": 8})
    again.apply({"action": "mig", "gpu": 1, "instances": 0})   # off: nothing kept
    assert again.kept == []
    again.apply({"action": "mig", "gpu": 2})
    control(home, {"action": "reboot"})
    again.step(0.0)
    assert again.kept == [] and mig_slots(again, 2) == 0
    again.stop()
