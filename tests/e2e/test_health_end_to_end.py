"""The health stage inside `gpumon run`: an XID 79 on a simulated host reaches /health, the hook and a
real Slurm's drain; the lost GPU and the verdict outlive a daemon restart, and a simulated reboot
undoes them and resumes the node."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time

import pytest

from gpumon.simulate import control
from tests.conftest import clean_env, http_get, wait_for
from tests.fakes.slurm import SlurmCluster

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SlurmCluster(tmp_path_factory.mktemp("slurm-e2e"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


def verdict(process) -> dict:
    status, _, body = http_get(process.url + "/health")
    return json.loads(body) if status == 200 else {}


def test_xid_79_drains_slurm_runs_the_hook_and_clear_resumes(gpumon_run, cluster, tmp_path) -> None:
    if cluster.state() != "idle":
        cluster.resume()
    calls = tmp_path / "hook-calls"
    hook = tmp_path / "hook.sh"
    hook.write_text(f"#!/bin/sh\ncat >> {calls}\necho >> {calls}\n")
    hook.chmod(hook.stat().st_mode | stat.S_IXUSR)
    env = {"SLURM_CONF": str(cluster.conf), "GPUMON_HEALTH_SLURM": "true", "GPUMON_HEALTH_HOOK": str(hook)}
    process = gpumon_run("--simulate", "nd-h100-v5", "--interval", "1", env=env)
    wait_for(lambda: verdict(process).get("status") == "healthy", timeout=20)
    start = time.monotonic()
    control(str(tmp_path / "state" / "simulate" / "nd-h100-v5"), {"action": "xid", "gpu": 3, "xid": 79})
    wait_for(lambda: verdict(process).get("status") == "unhealthy", timeout=10)
    to_health = time.monotonic() - start
    wait_for(lambda: cluster.state().startswith("drain"), timeout=10)
    to_drain = time.monotonic() - start
    assert re.match(r"gpumon: gpu\.(lost|xid\.79): GPU 3", cluster.reason()), cluster.reason()
    wait_for(lambda: calls.exists() and '"unhealthy"' in calls.read_text(), timeout=10)
    page = process.metrics()
    assert 'gpumon_health_action_runs_total{action="slurm"}' in page and "gpumon_node_health 2" in page
    print(f"XID 79 to /health unhealthy: {to_health:.2f} s; to the Slurm drain: {to_drain:.2f} s")

    # the daemon restarts: the simulated GPU is still lost (hardware state is kept, as on a real host),
    # the XID verdict is carried over and says so; the node stays drained
    code, output = process.stop()
    assert code == 0, output
    state_env = clean_env(GPUMON_DAEMON_STATE_DIR=str(tmp_path / "state"))
    status = subprocess.run([sys.executable, "-m", "gpumon", "health", "--simulate", "nd-h100-v5"],
                            env=state_env, capture_output=True, text=True, timeout=60)
    assert status.returncode == 1 and status.stdout.startswith("UNHEALTHY"), status.stdout  # sticky
    restarted = gpumon_run("--simulate", "nd-h100-v5", "--interval", "1", env=env)

    def restored() -> dict[str, bool]:
        return {f["rule"]: f["restored"] for f in verdict(restarted).get("findings", [])}

    # GPU 3 is found lost again by the new daemon (live); no new XID 79 comes, so that verdict stays restored
    wait_for(lambda: restored().get("gpu.lost") is False, timeout=20)
    assert restored()["gpu.xid.79"] is True
    assert cluster.state().startswith("drain")

    # the operator reboots the (simulated) node: a new boot id, the GPU whole, the verdicts gone, and
    # gpumon resumes the node it drained
    rebooted = subprocess.run([sys.executable, "-m", "gpumon", "simulate", "reboot", "--wait", "10"],
                              env=state_env, capture_output=True, text=True, timeout=30)
    assert rebooted.returncode == 0, rebooted.stdout + rebooted.stderr
    wait_for(lambda: verdict(restarted).get("status") == "healthy", timeout=20)
    wait_for(lambda: cluster.state() == "idle", timeout=15)


def test_gpumon_check_names_a_missing_scontrol(tmp_path) -> None:
    result = subprocess.run([sys.executable, "-m", "gpumon", "check", "--simulate", "nd-h100-v5"],
                            env=clean_env(GPUMON_DAEMON_STATE_DIR=str(tmp_path), GPUMON_HEALTH_SLURM="true",
                                          GPUMON_HEALTH_SCONTROL=os.path.join(str(tmp_path), "no-scontrol"),
                                          GPUMON_PROMETHEUS_LISTEN="127.0.0.1:0"),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "health    actions" in result.stdout and "no-scontrol" in result.stdout
