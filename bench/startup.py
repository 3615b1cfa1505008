"""Startup: from spawning ``gpumon run`` to the first 200 on /metrics, and to the first full page.

Three cases, each started several times (median and max quoted): ``gpumon run`` on this machine
(no GPU, no IB: the collectors report themselves unavailable), ``gpumon run --simulate nd-h100-v5``
(8 GPUs + 9 ports; "full" is the first page carrying both GPU and IB series), and node_exporter with
its infiniband collector on the same tree, for scale. The clock starts just before the fork.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from bench.common import (
    Endpoint,
    Options,
    clean_env,
    gpumon_serving,
    http_get,
    median,
    node_exporter_binary,
    node_exporter_serving,
    rnd,
    say,
    spawn,
    stop,
    wait_until,
)
from gpumon.simulate.sysfs import build_tree

TARGET_SECONDS = 1.0
FULL = (b"gpumon_gpu_info{", b"gpumon_ib_port_info{")


def time_to_page(cmd: list[str], env: dict[str, str] | None, endpoint: Endpoint,
                 full: tuple[bytes, ...] = ()) -> dict:
    t0 = time.perf_counter()
    proc = spawn(cmd, env)
    try:
        url = f"http://127.0.0.1:{endpoint.port(proc)}/metrics"

        def first() -> bytes | None:
            status, body = http_get(url, timeout=2.0)
            return body if status == 200 else None

        body = wait_until(first, 30, interval=0.002, alive=proc)
        out = {"first_200_seconds": time.perf_counter() - t0}
        if full:
            if not all(n in body for n in full):
                wait_until(lambda: all(n in (first() or b"") for n in full), 30, interval=0.005, alive=proc)
            out["full_page_seconds"] = time.perf_counter() - t0
        return out
    finally:
        stop(proc)


def import_seconds() -> float:
    """How long the interpreter takes to import the CLI and its plugins: the floor under startup."""
    code = ("import time; t=time.perf_counter(); import gpumon.cli, gpumon.daemon, gpumon.sinks.prometheus;"
            "from gpumon import registry; [registry.collector_class(n) for n in registry.available_collectors()];"
            "print(time.perf_counter()-t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=60)
    return float(out.stdout.strip() or "nan")


def interpreter_seconds() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=60)
    return time.perf_counter() - t0


def summarize(samples: list[dict], key: str) -> dict:
    values = [s[key] for s in samples if key in s]
    return {"median": rnd(median(values)), "max": rnd(max(values)), "all": [rnd(v) for v in values]}


def run(opts: Options) -> dict:
    repeats = 1 if opts.smoke else 7
    result: dict = {"repeats": repeats, "target_seconds": TARGET_SECONDS}
    with tempfile.TemporaryDirectory(prefix="gpumon-bench-startup-") as tmp:
        cases: list[tuple[str, list[str], dict[str, str] | None, Endpoint, tuple[bytes, ...]]] = []
        state = os.path.join(tmp, "state")
        env = clean_env(GPUMON_DAEMON_STATE_DIR=state)
        cmd, endpoint = gpumon_serving(tmp)
        cases.append(("gpumon run", cmd, env, endpoint, ()))
        cmd, endpoint = gpumon_serving(tmp, "--simulate", "nd-h100-v5")
        cases.append(("gpumon run --simulate nd-h100-v5", cmd, env, endpoint, FULL))
        binary = node_exporter_binary()
        if binary is not None:
            sysfs = os.path.join(tmp, "sys")
            build_tree("nd-h100-v5", sysfs)
            cmd, endpoint = node_exporter_serving(binary, sysfs)
            cases.append(("node_exporter --collector.infiniband", cmd, None, endpoint, ()))
        samples: dict[str, list[dict]] = {name: [] for name, *_ in cases}
        for _ in range(repeats):  # interleaved, so a slow moment hits every case alike
            for name, cmd, cenv, cport, full in cases:
                samples[name].append(time_to_page(cmd, cenv, cport, full))
        result["cases"] = {}
        for name, *_rest in cases:
            entry = {"first_200_seconds": summarize(samples[name], "first_200_seconds")}
            if "full_page_seconds" in samples[name][0]:
                entry["full_page_seconds"] = summarize(samples[name], "full_page_seconds")
            result["cases"][name] = entry
        result["python_startup_seconds"] = rnd(interpreter_seconds())
        result["gpumon_import_seconds"] = rnd(import_seconds())
    plain = result["cases"]["gpumon run"]["first_200_seconds"]["median"]
    sim = result["cases"]["gpumon run --simulate nd-h100-v5"]
    result["target_met"] = plain < TARGET_SECONDS and sim["first_200_seconds"]["median"] < TARGET_SECONDS
    for name, entry in result["cases"].items():
        full = f", full page {entry['full_page_seconds']['median']} s" if "full_page_seconds" in entry else ""
        say(opts, f"startup: {name}: first 200 after {entry['first_200_seconds']['median']} s "
                  f"(max {entry['first_200_seconds']['max']}){full}")
    say(opts, f"startup: target < {TARGET_SECONDS} s: {'met' if result['target_met'] else 'MISSED'}; "
              f"imports alone {result['gpumon_import_seconds']} s")
    return result
