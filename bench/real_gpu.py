"""The whole daemon on this host's real NVIDIA GPUs, at defaults, at ``--interval 1`` and with
``[nvml] per_process`` on.

Three ``gpumon run`` processes run side by side in the same window (each with its own
state directory and port, IMDS pointed at a closed port so that no Azure call is made): the process CPU
and every thread's CPU from ``/proc/<pid>/task/*/stat`` over the window, the ``nvml`` collector's runs
in it, and what the daemon found (GPU model, count, driver). On a host without a GPU (or without
nvidia-ml-py) it says so and measures nothing: this figure exists only where the driver does.

Unlike ``real_host`` (the NVML double, its cost taken out: gpumon's own share), this is what a GPU host
pays, the driver's own CPU included.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from typing import Any

from bench.common import (
    TICKS,
    Options,
    clean_env,
    collector_runs,
    cpu_seconds,
    gpumon_serving,
    http_get,
    rnd,
    running,
    say,
    wait_metrics,
)

WINDOW_S = 150.0
WARM_S = 20.0


def _threads(pid: int) -> dict[str, float]:
    """CPU seconds so far of each thread of ``pid``, by thread id."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii", errors="replace") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue    # the thread ended
        out[tid] = (int(fields[11]) + int(fields[12])) / TICKS
    return out


def _gpus(port: int) -> list[dict[str, str]]:
    _, body = http_get(f"http://127.0.0.1:{port}/metrics")
    found = []
    for line in body.decode(errors="replace").splitlines():
        if line.startswith("gpumon_gpu_info{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            found.append({k: labels.get(k, "") for k in ("gpu", "model", "driver_version")})
    return found


def _process_series(port: int) -> list[str]:
    """The per-process series the ``per_process`` daemon serves (none when nothing ran on a GPU)."""
    _, body = http_get(f"http://127.0.0.1:{port}/metrics")
    return [line for line in body.decode(errors="replace").splitlines() if line.startswith("gpumon_gpu_process_")]


def _has_gpu() -> str:
    """Empty when NVML answers with at least one GPU, else why not."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - any failure means no measurable GPU here
        return f"NVML unavailable: {exc}"
    return "" if count else "NVML counts no GPU"


def run(opts: Options) -> dict[str, Any]:
    why = _has_gpu()
    if why:
        say(opts, f"   not run: {why} (this benchmark needs a real NVIDIA GPU)")
        return {"not_run": why}
    window = 3.0 if opts.smoke else float(opts.extra.get("window_s", WINDOW_S))
    warm = 5.0 if opts.smoke else WARM_S
    with tempfile.TemporaryDirectory(prefix="gpumon-real-gpu-") as tmp, contextlib.ExitStack() as stack:
        per_process = os.path.join(tmp, "per_process.toml")
        with open(per_process, "w", encoding="utf-8") as fh:
            fh.write("[nvml]\nper_process = true\n")
        cases = {"defaults": (), "interval_1s": ("--interval", "1"), "per_process": ("--config", per_process)}
        procs, ports, endpoints = {}, {}, {}
        for name, extra in cases.items():
            env = clean_env(GPUMON_AZURE_IMDS_URL="http://127.0.0.1:1",
                            GPUMON_DAEMON_STATE_DIR=os.path.join(tmp, name))
            cmd, endpoints[name] = gpumon_serving(tmp, *extra)
            procs[name] = stack.enter_context(running(cmd, env, log=os.path.join(tmp, f"{name}.log")))
        for name, proc in procs.items():
            ports[name] = endpoints[name].port(proc)
            wait_metrics(ports[name], proc=proc)
        time.sleep(warm)
        t0 = time.monotonic()
        before = {n: (cpu_seconds(p.pid), _threads(p.pid), collector_runs(ports[n], "nvml")) for n, p in procs.items()}
        time.sleep(window)
        wall = time.monotonic() - t0
        result: dict[str, Any] = {"window_s": rnd(wall, 1), "gpus": _gpus(ports["defaults"]),
                                  "process_series": _process_series(ports["per_process"])}
        for name, proc in procs.items():
            cpu0, threads0, runs0 = before[name]
            cpu1, threads1, runs1 = cpu_seconds(proc.pid), _threads(proc.pid), collector_runs(ports[name], "nvml")
            per_thread = sorted(((t - threads0.get(tid, 0.0)) / wall * 1000 for tid, t in threads1.items()),
                                reverse=True)
            runs = (runs1 or 0) - (runs0 or 0)
            result[name] = {
                "share_of_one_core": rnd((cpu1 - cpu0) / wall, 5),
                "threads_ms_per_s": [rnd(v, 3) for v in per_thread if v > 0],
                "nvml_runs": runs,
            }
            say(opts, f"   {name}: {100 * (cpu1 - cpu0) / wall:.3f} % of one core, {runs:.0f} nvml runs, "
                      f"busiest threads {[round(v, 2) for v in per_thread[:4]]} ms/s")
    return result
