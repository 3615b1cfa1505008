"""Health: CPU to evaluate the rules on one ND H100 v5 snapshot, and an XID 79's way to ``/health``.

1. The rules: a HealthStage fed snapshots of a simulated ND H100 v5 (collected once, in process),
   thread CPU per ``update`` (``time.thread_time``), median of many; the part figure of the stage alone.
2. End to end: ``gpumon run --simulate nd-h100-v5`` at the default interval (10 s); an XID 79 dropped
   into the simulation's control directory; the time until ``GET /health`` says unhealthy. The
   simulated host reads its control directory once a second, so up to 1 s of the figure is the
   simulator's, not gpumon's: both the raw figure and the one less the control pick-up are given
   (the pick-up is timed by the simulated host's own log line).
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from bench.common import (
    Options,
    clean_env,
    gpumon_serving,
    http_get,
    median,
    rnd,
    running,
    say,
    simulator_pickup,
    wait_until,
)
from gpumon.health.rules import Thresholds
from gpumon.health.stage import HealthSettings, HealthStage
from gpumon.simulate import control

TARGET_EVAL_MS = 0.5
TARGET_XID_TO_HEALTH_S = 2.0


def _snapshots(directory: str, n: int) -> list:
    from tests.fakes.simulated_host import SimulatedHost

    host = SimulatedHost(directory)
    try:
        return [host.snapshot() for _ in range(n)]
    finally:
        host.close()


def eval_cpu(opts: Options) -> dict:
    rounds = 20 if opts.smoke else 400
    with tempfile.TemporaryDirectory(prefix="gpumon-bench-health-") as tmp:
        snaps = _snapshots(tmp, 3)
        stage = HealthStage(os.path.join(tmp, "state"), HealthSettings(Thresholds(), vm_size="Standard_ND96isr_H100_v5"))
        for snap in snaps * 10:  # warm up: the first updates read the state file and build caches
            stage.update(snap)
        times = []
        for i in range(rounds):
            snap = snaps[i % len(snaps)]
            t0 = time.thread_time()
            stage.update(snap)
            times.append((time.thread_time() - t0) * 1000)
    return {"rounds": rounds, "series_in_snapshot": sum(len(f.samples) for f in snaps[0].families),
            "eval_cpu_ms_median": rnd(median(times)), "target_ms": TARGET_EVAL_MS}


def _verdict(port: int) -> dict:
    try:
        status, body = http_get(f"http://127.0.0.1:{port}/health", timeout=2)
    except OSError:
        return {}
    return json.loads(body) if status == 200 else {}


def xid_to_health(opts: Options) -> dict:
    tries = 1 if opts.smoke else 5
    raw, less_pickup = [], []
    for _ in range(tries):
        with tempfile.TemporaryDirectory(prefix="gpumon-bench-xid-") as tmp:
            log = os.path.join(tmp, "gpumon.log")
            env = clean_env(GPUMON_DAEMON_STATE_DIR=tmp, GPUMON_LOG_LEVEL="info")
            cmd, endpoint = gpumon_serving(tmp, "--simulate", "nd-h100-v5")
            with running(cmd, env=env, log=log) as proc:
                port = endpoint.port(proc)
                wait_until(lambda p=port: _verdict(p).get("status") == "healthy", timeout=60)
                t0 = time.time()
                control(os.path.join(tmp, "simulate", "nd-h100-v5"), {"action": "xid", "gpu": 3, "xid": 79})
                wait_until(lambda p=port: _verdict(p).get("status") == "unhealthy", timeout=30)
                t1 = time.time()
            picked = simulator_pickup(log, "'xid'")
            raw.append(t1 - t0)
            less_pickup.append(t1 - (picked if picked and t0 <= picked <= t1 else t0))
    return {"tries": tries, "xid_to_health_s_median": rnd(median(raw)),
            "xid_to_health_less_simulator_pickup_s_median": rnd(median(less_pickup)),
            "target_s": TARGET_XID_TO_HEALTH_S}


def run(opts: Options) -> dict:
    result = {"rules": eval_cpu(opts), "xid_79": xid_to_health(opts)}
    say(opts, f"health rules on an ND H100 v5 snapshot: {result['rules']['eval_cpu_ms_median']} ms CPU "
              f"(target <= {TARGET_EVAL_MS}); XID 79 to /health unhealthy at the default interval: "
              f"{result['xid_79']['xid_to_health_s_median']} s, "
              f"{result['xid_79']['xid_to_health_less_simulator_pickup_s_median']} s after the simulated host "
              f"picked it up (target <= {TARGET_XID_TO_HEALTH_S})")
    return result
