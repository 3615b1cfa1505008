"""Rules that remember, and the operator's own XIDs: `[health] xids` adds or re-classifies an XID
(a malformed entry is exit 2 naming the key and the file); the same XID 13/31/43 on one GPU N times
in a window, XID 13/31 on the same GPC (parsed from the driver's own lines), a fault that comes back
after GPU resets and the node's remediation budget, each counted across restarts in health.json."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpumon.config import ConfigError, load
from gpumon.health.settings import HEALTH, health_settings
from gpumon.health.stage import HealthStage
from gpumon.health.state import clear
from gpumon.model import Event, MetricFamily, MetricSpec, MetricType, Sample, Severity, Snapshot
from gpumon.sources.driver_log import recognise
from tests.conftest import clean_env

XIDS = MetricSpec("gpumon_gpu_xid_errors_total", MetricType.COUNTER, "x", labels=("gpu", "xid"))
# tests/fixtures/kmsg/driver_lines.txt [R] (a real H100 host) and NVIDIA's XID 13 format
XID31_GPC1 = ("NVRM: Xid (PCI:0000:00:06): 31, pid=547, name=python3, channel 0x0000000a, intr 00000000. MMU Fault: "
              "ENGINE GRAPHICS GPC1 GPCCLIENT_T1_8 faulted @ 0x0_00000000. Fault is of type FAULT_PDE "
              "ACCESS_TYPE_VIRT_WRITE")
XID13_GPC3 = ("NVRM: Xid (PCI:0000:00:06): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on "
              "(GPC 3, TPC 1, SM 0): Out Of Range Address")


class Clock:
    def __init__(self) -> None:
        self.now = 1_750_000_000.0

    def __call__(self) -> float:
        return self.now


def snap(counts: dict[tuple[str, str], float], events: tuple[Event, ...] = (), energy: float | None = None) -> Snapshot:
    fams = [MetricFamily(XIDS, tuple(Sample((("gpu", g), ("xid", x)), v) for (g, x), v in sorted(counts.items())))]
    if energy is not None:
        spec = MetricSpec("gpumon_gpu_energy_joules_total", MetricType.COUNTER, "e", labels=("gpu",))
        fams.append(MetricFamily(spec, (Sample((("gpu", "0"),), energy),)))
    return Snapshot("node-1", 0.0, tuple(fams), events, ())


def make(tmp_path, clock: Clock, **section) -> HealthStage:
    return HealthStage(str(tmp_path / "state"), health_settings({**HEALTH.values(None), **section}), clock=clock,
                       boot="boot-1")


def rules(stage_result) -> dict[str, dict]:
    return {f["rule"]: f for f in stage_result.verdict.findings}


def test_an_operator_xid_is_judged_and_a_catalogue_one_can_be_reclassified(tmp_path) -> None:
    clock = Clock()
    s = make(tmp_path, clock, xids=[{"xid": 999, "level": "unhealthy", "action": "reboot", "sticky": True},
                                    {"xid": 48, "level": "ok"}, {"xid": 74, "level": "degraded"}])
    s.update(snap({("0", "999"): 0, ("0", "48"): 0, ("0", "74"): 0}))
    found = rules(s.update(snap({("0", "999"): 1, ("0", "48"): 1, ("0", "74"): 1})))
    assert found["gpu.xid.999"]["action"] == "reboot" and found["gpu.xid.999"]["sticky"] is True
    assert found["gpu.xid.74"]["severity"] == "degraded" and found["gpu.xid.74"]["action"] == "none"
    assert "gpu.xid.48" not in found  # the operator says 48 is not this fleet's hardware fault


@pytest.mark.parametrize("entry, words", [
    ('{ xid = 999, level = "broken" }', "entry 1 (xid 999): level must be one of ok, degraded, unhealthy"),
    ('{ xid = 999, level = "unhealthy", action = "pray" }', "action must be one of"),
    ('{ level = "unhealthy" }', "entry 1: xid must be an integer"),
    ('{ xid = 999, level = "ok", colour = "red" }', "unknown key 'colour'"),
    ('{ xid = 999, level = "ok", sticky = "yes" }', "sticky must be true or false"),
    ('{ xid = 9, level = "ok" }, { xid = 9, level = "degraded" }', "entry 2 (xid 9): xid 9 is listed twice"),
])
def test_a_malformed_xids_entry_is_exit_2_naming_the_key_and_the_file(tmp_path, entry, words) -> None:
    path = tmp_path / "gpumon.toml"
    path.write_text(f"[health]\nxids = [{entry}]\n")
    with pytest.raises(ConfigError) as caught:
        load([HEALTH], str(path), environ={})
    assert str(caught.value).startswith(f"{path}: [health] xids: ") and words in str(caught.value)
    result = subprocess.run([sys.executable, "-m", "gpumon", "check", "--config", str(path)], capture_output=True,
                            text=True, timeout=60, env=clean_env(), check=False)
    assert result.returncode == 2, result.stderr
    assert f"{path}: [health] xids:" in result.stderr and words in result.stderr


def test_xids_from_the_environment_use_toml_inline_syntax(tmp_path) -> None:
    cfg = load([HEALTH], None, environ={"GPUMON_HEALTH_XIDS": '[{ xid = 999, level = "degraded" }]',
                                       "GPUMON_HEALTH_XID_REPEAT": "13,31"})
    assert cfg["health"]["xids"] == [{"xid": 999, "level": "degraded"}]
    assert cfg["health"]["xid_repeat"] == [13, 31]
    with pytest.raises(ConfigError, match="GPUMON_HEALTH_XIDS"):
        load([HEALTH], None, environ={"GPUMON_HEALTH_XIDS": "[{ xid = 999"})


def test_the_same_xid_five_times_in_a_day_on_one_gpu_is_the_gpu_and_survives_a_restart(tmp_path) -> None:
    clock = Clock()
    s = make(tmp_path, clock)
    s.update(snap({("0", "13"): 0, ("1", "13"): 0}))
    for n in range(1, 5):
        clock.now += 3600
        found = rules(s.update(snap({("0", "13"): n, ("1", "13"): 1})))
        assert "gpu.xid.repeated" not in found and "gpu.xid.13" not in found  # an application's fault, so far
    s.close()
    s = make(tmp_path, clock)  # a restart: the four are remembered
    clock.now += 3600
    found = rules(s.update(snap({("0", "13"): 5, ("1", "13"): 1})))
    assert found["gpu.xid.repeated"]["subject"] == {"gpu": "0"}
    assert found["gpu.xid.repeated"]["reason"] == "GPU 0: XID 13 5 times in 24 h"
    assert found["gpu.xid.repeated"]["severity"] == "unhealthy"
    state = json.loads((tmp_path / "state" / "health.json").read_text())
    assert len(state["history"]["xid_times"]["0|13"]) == 5
    clock.now += 86400 - 3600 * 4 + 1  # the first ones leave the window: below the threshold again
    s.update(snap({("0", "13"): 5, ("1", "13"): 1}))
    clock.now += 301  # and the hold time passes
    assert "gpu.xid.repeated" not in rules(s.update(snap({("0", "13"): 5, ("1", "13"): 1})))


def test_the_gpc_is_read_from_the_drivers_lines() -> None:
    for line, gpc in ((XID31_GPC1, 1), (XID13_GPC3, 3)):
        msg = recognise(line)
        assert msg is not None and msg.attrs["gpc"] == gpc
    no_gpc = recognise("NVRM: Xid (PCI:0000:18:00): 31, pid=30498, name=pt_main_thread, Ch 00000008, intr "
                       "10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f2a_3c000000.")
    assert no_gpc is not None and "gpc" not in no_gpc.attrs


def test_xid_13_and_31_on_the_same_gpc_twice_is_the_gpc(tmp_path) -> None:
    clock = Clock()
    s = make(tmp_path, clock)

    def event(line: str) -> Event:
        msg = recognise(line)
        assert msg is not None
        return Event("gpu_xid", Severity.ERROR, {"pci_bus_id": "00000000:00:06.0", "gpu": "0"}, line,
                     {**msg.attrs, "line": line, "source": "kmsg"}, clock.now)

    assert "gpu.xid.same_gpc" not in rules(s.update(snap({}, (event(XID31_GPC1), event(XID13_GPC3)))))
    clock.now += 600
    found = rules(s.update(snap({}, (event(XID31_GPC1),))))
    assert found["gpu.xid.same_gpc"]["reason"] == "GPU 0: XID 13/31 on GPC 1 2 times in 24 h"


def test_a_fault_that_keeps_coming_back_after_resets_is_replace_hardware(tmp_path) -> None:
    clock = Clock()
    s = make(tmp_path, clock)
    energy = 1000.0
    s.update(snap({("0", "48"): 0}, energy=energy))
    for cycle in range(3):
        count = cycle + 1
        energy += 100
        clock.now += 600
        assert "gpu.xid.48" in rules(s.update(snap({("0", "48"): count}, energy=energy)))
        energy = 10.0 * (cycle + 1)  # the GPU was reset: its energy counter starts again
        clock.now += 600
        found = rules(s.update(snap({("0", "48"): count}, energy=energy)))
        assert "gpu.xid.48" not in found
    assert found["gpu.reset.repeated"]["action"] == "replace_hardware"
    assert found["gpu.reset.repeated"]["reason"] == "GPU 0: a reset cleared a hardware fault 3 times in 7 days"


def test_more_than_five_remediations_in_a_week_is_replace_hardware_and_stops_counting(tmp_path) -> None:
    clock = Clock()
    s = make(tmp_path, clock, hold_seconds=0.0)
    s.update(snap({("0", "79"): 0}))
    count = 0
    for n in range(6):
        count += 1
        clock.now += 3600
        s.update(snap({("0", "79"): count}))  # XID 79: unhealthy, reboot (a drain)
        clock.now += 1
        s.close()
        clear(str(tmp_path / "state"), "gpu.xid.79")  # the operator rebooted it and cleared the verdict
        s = make(tmp_path, clock, hold_seconds=0.0)
        if n < 5:
            assert "node.remediation_budget" not in rules(s.update(snap({("0", "79"): count})))
    found = rules(s.update(snap({("0", "79"): count})))
    assert found["node.remediation_budget"]["action"] == "replace_hardware"
    assert "6 times in 7 days (budget 5)" in found["node.remediation_budget"]["reason"]
    result = s.update(snap({("0", "79"): count + 1}))
    assert result.verdict.action == "replace_hardware" and result.verdict.budget_spent
    state = json.loads((tmp_path / "state" / "health.json").read_text())
    assert len(state["history"]["remediations"]) == 6  # spent: nothing counted (or filed) again


def test_clearing_the_budget_after_the_repair_starts_the_count_again_in_the_running_daemon(tmp_path) -> None:
    clock = Clock()
    s = make(tmp_path, clock, hold_seconds=0.0, remediation_budget=1)
    s.update(snap({("0", "79"): 0}))
    for count in (1, 2):
        clock.now += 3600
        s.update(snap({("0", "79"): count}))
        clear(str(tmp_path / "state"), "gpu.xid.79")
        clock.now += 1
        s.update(snap({("0", "79"): count}))
    assert "node.remediation_budget" in rules(s.update(snap({("0", "79"): 2})))
    assert clear(str(tmp_path / "state"), "node.remediation_budget") == ["node.remediation_budget"]
    clock.now += 1
    assert rules(s.update(snap({("0", "79"): 2}))) == {}
    state = json.loads((tmp_path / "state" / "health.json").read_text())
    assert state["history"]["remediations"] == []


def test_the_kmsg_collectors_xid_31_lines_reach_the_gpc_rule(tmp_path) -> None:
    """End to end from dev-kmsg records: the collector's gpu_xid events carry the GPC, and the stage
    judges the GPU the PCI address names."""
    from tests.support.kmsg import rig, usec_ago

    log, collector = rig(tmp_path)
    log.record(1, XID31_GPC1, prio=4, usec=usec_ago(20))
    log.record(2, XID13_GPC3.replace("GPC 3", "GPC 1"), prio=4, usec=usec_ago(10))
    out = collector.collect()
    assert [e.attributes.get("gpc") for e in out.events if e.kind == "gpu_xid"] == [1, 1]
    info = MetricFamily(MetricSpec("gpumon_gpu_info", MetricType.INFO, "i", labels=("gpu", "pci_bus_id")),
                        (Sample((("gpu", "5"), ("pci_bus_id", "00000000:00:06.0")), 1.0),))
    clock = Clock()
    s = make(tmp_path, clock)
    found = rules(s.update(Snapshot("node-1", 0.0, (info,), tuple(out.events), ())))
    assert found["gpu.xid.same_gpc"]["subject"] == {"gpu": "5"}
