"""Straggler detection end to end: 8 simulated ND H100 v5 hosts (64 GPUs) in one job, a real Prometheus.

Eight ``gpumon run --simulate nd-h100-v5 --interval 1`` processes hold all their GPUs for job 4242, so
they move in the job's step rhythm (gpumon/simulate/job.py); Prometheus scrapes them every second and
evaluates the rules every second: deploy/prometheus's rule files (with 1 s groups) where job-rules.yaml
exists, else the stand-in of tests/fakes/job_rules.py (the result says which).

1. **Healthy window**: after the rules' windows have filled, ``max(gpumon_job:straggler_score)`` is read
   every second for ``--healthy-seconds`` (600 by default, the issue's 10 minutes); a false positive is
   a second where any GPU's score crosses the alert threshold.
2. **One fault at a time**: throttle GPU 5 of node-3 to 0.7 for each reason, then congest one IB port;
   the clock starts as the control file is dropped and stops at the first instant query whose
   ``topk(1, ...)`` is the degraded GPU with its signal named, that is standing out of the job's noise
   (or, for the port, its host in the roll-up on an ``ib_*`` signal), polled every 0.25 s (goal: within 60 s), and then until its score passes the alert threshold
   (the alert's own ``for:`` comes on top of that). The fault is then undone, and the next one starts
   once no score is past the threshold and the degraded GPU and host are no longer the highest.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

import yaml

from bench.common import (
    Options,
    clean_env,
    gpumon_serving,
    picked_port,
    prometheus_binary,
    rnd,
    say,
    spawn,
    stop,
    tool_version,
    wait_until,
)
from gpumon.fleet.promql import Client, QueryFailed
from gpumon.simulate import control

JOB = "4242"
HOSTS = 8
SLOW_HOST, SLOW_GPU = 3, 5
CONGESTED = ("mlx5_ib2", 1)
GOAL_SECONDS = 60.0
CASE_TIMEOUT = 120.0
COLLECTORS = "nvml,infiniband,linkflap,attribution"
FAULTS: tuple[tuple[str, dict[str, Any], dict[str, Any]], ...] = (
    ("throttle sw_power_cap 0.7",
     {"action": "throttle", "gpu": SLOW_GPU, "reason": "sw_power_cap", "factor": 0.7},
     {"action": "restore", "gpu": SLOW_GPU}),
    ("throttle hw_thermal_slowdown 0.7",
     {"action": "throttle", "gpu": SLOW_GPU, "reason": "hw_thermal_slowdown", "factor": 0.7},
     {"action": "restore", "gpu": SLOW_GPU}),
    ("throttle hw_slowdown 0.7",
     {"action": "throttle", "gpu": SLOW_GPU, "reason": "hw_slowdown", "factor": 0.7},
     {"action": "restore", "gpu": SLOW_GPU}),
    (f"congest {CONGESTED[0]} 0.5",
     {"action": "congest", "device": CONGESTED[0], "port": CONGESTED[1], "factor": 0.5},
     {"action": "restore", "device": CONGESTED[0], "port": CONGESTED[1]}),
)


def rules(tmp: str) -> tuple[list[str], str, float]:
    """(rule files, which, alert threshold): deploy/prometheus's at 1 s evaluation, else the stand-in."""
    from tests.fakes import job_rules

    paths, threshold = job_rules.rule_files(tmp)
    if not os.path.exists(job_rules.SHIPPED):
        return paths, "tests/fakes/job_rules.py (stand-in)", threshold
    with open(job_rules.SHIPPED, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()[:12]
    return paths, f"deploy/prometheus (job-rules.yaml sha256 {digest})", threshold


def top(client: Client, metric: str) -> dict[str, str] | None:
    found = client.query(f'topk(1, {metric}{{job_id="{JOB}"}})')
    return found[0].labels if found else None


def worst(client: Client) -> float:
    found = client.query(f'max(gpumon_job:straggler_score{{job_id="{JOB}"}})')
    return found[0].value if found else math.nan


def run(opts: Options) -> dict[str, Any]:
    server = prometheus_binary(opts)
    if server is None:
        return {"not_run": "needs the prometheus server"}
    healthy_seconds = float(opts.extra.get("healthy_seconds", 10 if opts.smoke else 600))
    warmup = 5.0 if opts.smoke else 130.0   # the rules' [2m] averages fill before anything is judged
    faults = FAULTS[:1] if opts.smoke else FAULTS
    if opts.extra.get("faults"):
        faults = tuple(f for f in faults if opts.extra["faults"] in f[0])
    tmp = tempfile.mkdtemp(prefix="gpumon-bench-job-")
    procs: list[subprocess.Popen] = []
    try:
        workdirs, endpoints = [], []
        for i in range(HOSTS):
            state = os.path.join(tmp, f"node-{i}")
            cmd, endpoint = gpumon_serving(tmp, "--simulate", "nd-h100-v5", "--interval", "1", "--collectors",
                                           COLLECTORS)
            procs.append(spawn(cmd, clean_env(GPUMON_DAEMON_STATE_DIR=state), os.path.join(tmp, f"node-{i}.log")))
            endpoints.append(endpoint)
            workdirs.append(os.path.join(state, "simulate", "nd-h100-v5"))
        ports = [endpoint.port(proc) for endpoint, proc in zip(endpoints, procs)]
        rule_files, which, threshold = rules(tmp)
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                  "rule_files": rule_files,
                  "scrape_configs": [{"job_name": "gpumon", "static_configs": [
                      {"targets": [f"127.0.0.1:{p}"], "labels": {"instance": f"node-{i}:9470"}}
                      for i, p in enumerate(ports)]}]}
        with open(os.path.join(tmp, "prometheus.yml"), "w", encoding="utf-8") as fh:
            yaml.safe_dump(config, fh)
        prom_port = picked_port()  # Prometheus cannot say which port it bound
        procs.append(spawn([server, f"--config.file={tmp}/prometheus.yml", f"--storage.tsdb.path={tmp}/data",
                            f"--web.listen-address=127.0.0.1:{prom_port}"], log=os.path.join(tmp, "prometheus.log")))
        for workdir in workdirs:
            wait_until(lambda workdir=workdir: os.path.isdir(os.path.join(workdir, "control")), 60, 0.1)
            for gpu in range(8):
                control(workdir, {"action": "allocate", "gpu": gpu, "job_id": JOB})
        client = Client(f"http://127.0.0.1:{prom_port}", timeout=30)  # a loaded machine answers late, not never

        def scored() -> bool:
            try:
                return len(client.query(f'gpumon_job:straggler_score{{job_id="{JOB}", gpu!=""}}')) == HOSTS * 8
            except QueryFailed:
                return False

        wait_until(scored, 120, 0.5)
        say(opts, f"  64 GPUs scored ({which}); {warmup:g} s for the rule windows to fill")
        time.sleep(warmup)

        # 1. healthy window: one reading a second
        readings: list[float] = []
        deadline = time.monotonic() + healthy_seconds
        while time.monotonic() < deadline:
            tick = time.monotonic()
            readings.append(worst(client))
            time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
        over = [v for v in readings if v > threshold]
        healthy = {"seconds": healthy_seconds, "readings": len(readings), "threshold": threshold,
                   "max_score": rnd(max(readings)), "median_of_max": rnd(sorted(readings)[len(readings) // 2]),
                   "false_positive_seconds": len(over)}
        say(opts, f"  healthy {healthy_seconds:g} s: max score {healthy['max_score']} "
                  f"(threshold {threshold:g}), {len(over)} s over it")

        # 2. one fault at a time
        cases: dict[str, Any] = {}
        def named(metric: str, want: dict[str, str], ib: bool) -> dict[str, str] | None:
            labels = top(client, metric)
            # the degraded member on top, standing out: its signal is named (the shipped rules name it
            # past 3 robust standard deviations; below that every member's score is noise, and the top
            # one is whichever is noisiest)
            if labels and all(labels.get(k) == v for k, v in want.items()) and labels.get("signal") and (
                    not ib or labels.get("signal", "").startswith("ib_")):
                return labels
            return None

        gpu_want = {"instance": f"node-{SLOW_HOST}:9470", "gpu": str(SLOW_GPU)}
        host_want = {"instance": f"node-{SLOW_HOST}:9470"}
        for name, fault, undo in faults:
            host_level = fault["action"] == "congest"
            want = host_want if host_level else gpu_want
            metric = "gpumon_job_host:straggler_score" if host_level else "gpumon_job:straggler_score"
            control(workdirs[SLOW_HOST], fault)
            started = time.monotonic()
            found: float | None = None
            signal = ""
            while time.monotonic() - started < CASE_TIMEOUT:
                labels = named(metric, want, host_level)
                if labels:
                    found, signal = time.monotonic() - started, labels.get("signal", "")
                    break
                time.sleep(0.25)
            # then on until its score crosses the alert threshold (the alert's `for:` comes on top)
            crossed: float | None = None
            while found is not None and time.monotonic() - started < CASE_TIMEOUT:
                labels = named(metric, want, host_level)
                if labels and worst(client) > threshold:
                    crossed = time.monotonic() - started
                    break
                time.sleep(0.25)
            score = worst(client)
            cases[name] = {"seconds_to_highest": round(found, 1) if found is not None else None,
                           "seconds_to_threshold": round(crossed, 1) if crossed is not None else None,
                           "signal": signal, "score_then": rnd(score),
                           "within_goal": found is not None and found <= GOAL_SECONDS}
            say(opts, f"  {name}: " + (f"highest after {found:.1f} s (signal {signal}), past {threshold:g} after "
                                       + (f"{crossed:.1f} s" if crossed is not None else f"more than {CASE_TIMEOUT:g} s")
                                       if found is not None else f"not the highest within {CASE_TIMEOUT:g} s"))
            control(workdirs[SLOW_HOST], undo)
            def settled() -> bool:
                try:
                    return worst(client) <= threshold and not named("gpumon_job:straggler_score", gpu_want, False) \
                        and not named("gpumon_job_host:straggler_score", host_want, False)
                except QueryFailed:
                    return False

            try:   # the next fault starts from a job where nothing of this one stands out
                wait_until(settled, 300, 1.0)
            except TimeoutError:
                cases[name]["settled"] = False
        return {"prometheus": tool_version(server), "hosts": HOSTS, "gpus": HOSTS * 8, "scrape_interval_seconds": 1, "rules": which,
                "goal_seconds": GOAL_SECONDS, "healthy": healthy, "faults": cases,
                "target_met": healthy["false_positive_seconds"] == 0
                and all(c["within_goal"] for c in cases.values())}
    finally:
        for proc in reversed(procs):
            stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)
