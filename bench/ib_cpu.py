"""IB collection CPU: one full gpumon infiniband run against one node_exporter infiniband scrape.

Both read the same ND H100 v5 tree (8 x NDR + mlx5_an0). gpumon's collector runs in a worker
process, node_exporter is scraped over loopback; each process's CPU comes from ``/proc/<pid>/stat``.
Rounds alternate which side goes first; each round gives one ratio, and the figure is the median of
the ratios (so a noisy neighbour in one round does not move it). gpumon's page is pre-rendered, so
its cost per scrape is its cost per run; node_exporter collects on every scrape.
"""

from __future__ import annotations

import os
import tempfile

from bench.common import (
    Options,
    cpu_seconds,
    http_get,
    median,
    node_exporter_binary,
    node_exporter_serving,
    rnd,
    running,
    say,
    series_count,
    tool_version,
    wait_metrics,
)
from bench.workers import Worker
from gpumon.simulate.sysfs import build_tree

TARGET_RATIO = 0.5


def tree_files(root: str) -> int:
    """Attribute files under class/infiniband/*/ports/*: what one full run reads."""
    base = os.path.join(root, "class", "infiniband")
    total = 0
    for device in os.listdir(base):
        ports = os.path.join(base, device, "ports")
        for _dirpath, _dirs, files in os.walk(ports, followlinks=True):
            total += sum(1 for f in files if not f.startswith("."))
    return total


def run(opts: Options) -> dict:
    rounds = 3 if opts.smoke else 15
    g_batch = 100 if opts.smoke else 300   # smoke: enough runs for a few 10 ms /proc ticks
    ne_batch = 3 if opts.smoke else 60
    with tempfile.TemporaryDirectory(prefix="gpumon-bench-ib-") as tmp:
        sysfs = os.path.join(tmp, "sys")
        fabric = build_tree("nd-h100-v5", sysfs)
        result: dict = {"tree": "nd-h100-v5", "ports": len(fabric.port_keys), "files": tree_files(sysfs),
                        "rounds": rounds, "gpumon_runs_per_round": g_batch,
                        "node_exporter_scrapes_per_round": ne_batch, "target_ratio": TARGET_RATIO}
        binary = node_exporter_binary()
        with Worker("infiniband", sysfs, os.path.join(tmp, "state"), "pread") as ib, \
                Worker("infiniband", sysfs, os.path.join(tmp, "state-open"), "open") as ib_open:
            result["gpumon_series"] = ib.series
            ib.run(g_batch)  # warm
            if binary is None:
                result["node_exporter"] = None
                result["error"] = "node_exporter is not installed (Debian: prometheus-node-exporter)"
                cpu, own, _ = ib.run(g_batch)
                result["gpumon_cpu_ms_per_run"] = rnd(own / g_batch * 1e3)
                return result
            ne_cmd, endpoint = node_exporter_serving(binary, sysfs)
            with running(ne_cmd) as ne:
                port = endpoint.port(ne)
                url = f"http://127.0.0.1:{port}/metrics"
                body = wait_metrics(port, proc=ne)
                result["node_exporter"] = tool_version(binary)
                result["node_exporter_series"] = sum(
                    1 for line in body.splitlines() if line.startswith(b"node_infiniband_"))
                result["node_exporter_page_series"] = series_count(body)
                for _ in range(ne_batch):
                    http_get(url)
                g_proc, g_own, n_proc, ratios, ratios_own = [], [], [], [], []
                for r in range(rounds):
                    sides = ["gpumon", "node_exporter"] if r % 2 == 0 else ["node_exporter", "gpumon"]
                    for side in sides:
                        if side == "gpumon":
                            cpu, own, _wall = ib.run(g_batch)
                            g_proc.append(cpu / g_batch)
                            g_own.append(own / g_batch)
                        else:
                            c0 = cpu_seconds(ne.pid)
                            for _ in range(ne_batch):
                                status, _ = http_get(url)
                                if status != 200:
                                    raise RuntimeError(f"node_exporter answered {status}")
                            n_proc.append((cpu_seconds(ne.pid) - c0) / ne_batch)
                    ratios.append(g_proc[-1] / n_proc[-1] if n_proc[-1] else float("inf"))
                    ratios_own.append(g_own[-1] / n_proc[-1] if n_proc[-1] else float("inf"))
                _, open_own, _ = ib_open.run(g_batch)
        result.update({
            "gpumon_cpu_ms_per_run": rnd(median(g_proc) * 1e3),
            "gpumon_cpu_ms_per_run_process_time": rnd(median(g_own) * 1e3),
            "gpumon_cpu_ms_per_run_open_mode": rnd(open_own / g_batch * 1e3),
            "node_exporter_cpu_ms_per_scrape": rnd(median(n_proc) * 1e3),
            "ratio_median": rnd(median(ratios)),
            "ratio_median_process_time": rnd(median(ratios_own)),
            "ratios": [rnd(x) for x in ratios],
        })
        result["target_met"] = result["ratio_median"] <= TARGET_RATIO
        say(opts, f"ib_cpu: gpumon {result['gpumon_cpu_ms_per_run']} ms/run ({ib.series} series, "
                  f"{result['files']} files) vs node_exporter {result['node_exporter_cpu_ms_per_scrape']} "
                  f"ms/scrape: ratio {result['ratio_median']} (target <= {TARGET_RATIO})")
    return result
