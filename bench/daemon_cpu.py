"""What a user pays: the whole ``gpumon run`` process per IB collection, and the idle daemon.

``per_run``: ``gpumon run --collectors infiniband --interval 0.05`` on the ND H100 v5 tree (pread),
its process CPU from ``/proc/<pid>/stat`` (every thread: collect, snapshot, render, self-metrics,
health, the loop, the implied linkflap watcher, the endpoint) divided by the growth of
``gpumon_collector_runs_total{collector="infiniband"}``; node_exporter 1.5's infiniband collector is
scraped on the same tree in the same rounds, alternating which side goes first. The figure is the
median of the per-round ratios. ``idle``: the share of one core of ``gpumon run`` at defaults, on a
host with no GPU and no IB (an empty sysfs root), and on the static ND H100 v5 tree, read as on /sys
(``pread``, the default there). Off Azure (the IMDS URL points at a closed loopback port).
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from bench.common import (
    Options,
    clean_env,
    collector_runs,
    cpu_seconds,
    gpumon_serving,
    http_get,
    median,
    node_exporter_binary,
    node_exporter_serving,
    rnd,
    running,
    say,
    shown,
    wait_metrics,
    wait_until,
)
from gpumon.simulate.sysfs import build_tree

TARGET_RATIO = 0.5
TARGET_IDLE_EMPTY = 0.001
TARGET_IDLE_TREE = 0.002
def ib_runs(port: int) -> float:
    """gpumon_collector_runs_total of the infiniband collector, from the endpoint."""
    return collector_runs(port, "infiniband")


POLL = 0.25
"""Seconds between looks at the page while waiting for a publish (up to 20 scrapes per round end;
their CPU counts against gpumon)."""


def fresh_runs(pid: int, port: int, limit: float = 12.0) -> tuple[float, float]:
    """(CPU seconds, IB runs) read just after the page changed: run counts reach the page with the
    loop's bookkeeping publish (every few seconds), so a count read at any other moment is stale."""
    before = ib_runs(port)
    end = time.monotonic() + limit
    while time.monotonic() < end:
        time.sleep(POLL)
        runs = ib_runs(port)
        if runs != before:
            return cpu_seconds(pid), runs
    raise RuntimeError("the page's IB run count did not move")


def gpumon_round(pid: int, port: int, seconds: float) -> tuple[float, float]:
    """(CPU seconds, IB runs) over at least ``seconds`` of the running daemon, from one publish of
    the page to another."""
    c0, r0 = fresh_runs(pid, port)
    time.sleep(seconds)
    c1, r1 = fresh_runs(pid, port)
    return c1 - c0, r1 - r0


def ne_round(pid: int, url: str, scrapes: int) -> float:
    """node_exporter CPU seconds per scrape over ``scrapes`` back-to-back scrapes."""
    c0 = cpu_seconds(pid)
    for _ in range(scrapes):
        status, _ = http_get(url)
        if status != 200:
            raise RuntimeError(f"node_exporter answered {status}")
    return (cpu_seconds(pid) - c0) / scrapes


def per_run(opts: Options, tmp: str, sysfs: str) -> dict[str, Any]:
    rounds = 3 if opts.smoke else 11
    seconds = 1.0 if opts.smoke else 6.0
    ne_batch = 3 if opts.smoke else 60
    cmd, endpoint = gpumon_serving(tmp, "--collectors", "infiniband", "--interval", "0.05", "--sysfs-root", sysfs,
                                   "--log-level", "warning")
    env = clean_env(GPUMON_DAEMON_STATE_DIR=os.path.join(tmp, "state-run"), GPUMON_INFINIBAND_READ_MODE="pread")
    result: dict[str, Any] = {"command": shown(cmd), "read_mode": "pread", "rounds": rounds,
                              "seconds_per_round": seconds, "target_ratio": TARGET_RATIO}
    binary = node_exporter_binary()
    with running(cmd, env) as proc:
        port = endpoint.port(proc)
        wait_metrics(port, proc=proc)
        wait_until(lambda: ib_runs(port) >= 20, 20.0)
        gpumon_round(proc.pid, port, 1.0)  # warm
        if binary is None:
            cpu, runs = gpumon_round(proc.pid, port, seconds)
            result["gpumon_cpu_ms_per_run"] = rnd(cpu / max(runs, 1) * 1e3)
            result["error"] = "node_exporter is not installed (Debian: prometheus-node-exporter)"
            return result
        ne_cmd, ne_endpoint = node_exporter_serving(binary, sysfs)
        with running(ne_cmd) as ne:
            ne_port = ne_endpoint.port(ne)
            url = f"http://127.0.0.1:{ne_port}/metrics"
            wait_metrics(ne_port, proc=ne)
            ne_round(ne.pid, url, ne_batch)  # warm
            g, n, ratios, runs_per_s = [], [], [], []
            for r in range(rounds):
                for side in (("gpumon", "ne") if r % 2 == 0 else ("ne", "gpumon")):
                    if side == "gpumon":
                        started = time.monotonic()
                        cpu, runs = gpumon_round(proc.pid, port, seconds)
                        g.append(cpu / max(runs, 1))
                        runs_per_s.append(runs / (time.monotonic() - started))  # about: from the first poll
                    else:
                        n.append(ne_round(ne.pid, url, ne_batch))
                ratios.append(g[-1] / n[-1] if n[-1] else float("inf"))
    result.update({
        "gpumon_cpu_ms_per_run": rnd(median(g) * 1e3),
        "gpumon_runs_per_second": rnd(median(runs_per_s), 1),
        "node_exporter_cpu_ms_per_scrape": rnd(median(n) * 1e3),
        "ratio_median": rnd(median(ratios)),
        "ratios": [rnd(x) for x in ratios],
    })
    result["target_met"] = result["ratio_median"] <= TARGET_RATIO
    return result


def idle_share(opts: Options, tmp: str, name: str, sysfs: str, *extra: str) -> dict[str, Any]:
    """Share of one core of ``gpumon run`` at defaults (plus ``extra``) over a quiet period."""
    seconds = 3.0 if opts.smoke else 60.0  # /proc counts 10 ms ticks: 0.017 % of a core a tick
    cmd, endpoint = gpumon_serving(tmp, "--sysfs-root", sysfs, "--log-level", "warning", *extra)
    # a tree other than /sys is read by opening each file (it may be replaced); on /sys, as on a real
    # host, the default keeps the files open and preads them: the tree cases read as /sys is read
    env = clean_env(GPUMON_DAEMON_STATE_DIR=os.path.join(tmp, f"state-{name}"), GPUMON_INFINIBAND_READ_MODE="pread",
                    GPUMON_AZURE_IMDS_URL="http://127.0.0.1:1")
    with running(cmd, env) as proc:
        wait_metrics(endpoint.port(proc), proc=proc)
        time.sleep(1.0 if opts.smoke else 15.0)  # first runs, imports, first page
        c0, t0 = cpu_seconds(proc.pid), time.monotonic()
        time.sleep(seconds)
        c1, t1 = cpu_seconds(proc.pid), time.monotonic()
    return {"command": shown(cmd), "seconds": rnd(t1 - t0, 1),
            "cpu_seconds": rnd(c1 - c0, 4), "share_of_one_core": rnd((c1 - c0) / (t1 - t0), 6)}


def run(opts: Options, parts: tuple[str, ...] = ("per_run", "idle")) -> dict[str, Any]:
    data: dict[str, Any] = {"tree": "nd-h100-v5"}
    with tempfile.TemporaryDirectory(prefix="gpumon-bench-daemon-") as tmp:
        sysfs = os.path.join(tmp, "sys")
        fabric = build_tree("nd-h100-v5", sysfs)
        data["ports"] = len(fabric.port_keys)
        if "per_run" in parts:
            data["per_run"] = per_run(opts, tmp, sysfs)
            pr = data["per_run"]
            say(opts, f"daemon_cpu: whole daemon {pr['gpumon_cpu_ms_per_run']} ms per IB run vs node_exporter "
                      f"{pr.get('node_exporter_cpu_ms_per_scrape')} ms per scrape: ratio {pr.get('ratio_median')} "
                      f"(target <= {TARGET_RATIO})")
        if "idle" in parts:
            empty = os.path.join(tmp, "empty-sys")
            os.makedirs(empty)
            data["idle"] = {"no_gpu_no_ib": idle_share(opts, tmp, "empty", empty),
                            "nd_h100_v5_tree": idle_share(opts, tmp, "tree", sysfs),
                            "nd_h100_v5_tree_1s": idle_share(opts, tmp, "tree1", sysfs, "--interval", "1")}
            for key, value in data["idle"].items():
                say(opts, f"daemon_cpu: idle {key}: {value['share_of_one_core'] * 100:.3f} % of one core")
    return data


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(Options(), tuple(sys.argv[1:]) or ("per_run", "idle")), indent=1))
