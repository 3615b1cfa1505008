#!/usr/bin/env python3
"""CPU cost of one infiniband collector run and one linkflap watcher run on a simulated tree.

Standalone: builds the tree in a temporary directory, runs each collector many times, and prints
JSON with the median CPU time per run (time.process_time). The tree is static while measuring, so
``pread`` mode (what a real sysfs gets) can be measured on a tmpfs/disk tree too.

    python bench/ib_cost.py [--profile nd-h100-v5] [--ports N] [--runs 500]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from gpumon.collectors.base import Context
from gpumon.collectors.infiniband import InfinibandCollector
from gpumon.collectors.linkflap import LinkflapCollector
from gpumon.config import Section
from gpumon.simulate.sysfs import build_tree


def per_run(collect, runs: int) -> dict[str, float]:
    for _ in range(min(20, runs)):  # warm caches and the fd table
        collect()
    cpu, wall = [], []
    for _ in range(runs):
        c0, w0 = time.process_time(), time.perf_counter()
        collect()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return {
        "cpu_seconds_median": statistics.median(cpu),
        "cpu_seconds_p90": sorted(cpu)[int(len(cpu) * 0.9)],
        "wall_seconds_median": statistics.median(wall),
    }


def node_exporter(sysfs: str, runs: int) -> dict[str, object] | None:
    """The same tree through node_exporter's infiniband collector: its CPU per scrape, from /proc."""
    binary = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    if binary is None:
        return None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [binary, f"--web.listen-address=127.0.0.1:{port}", f"--path.sysfs={sysfs}",
         "--collector.disable-defaults", "--collector.infiniband"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                body = urllib.request.urlopen(url, timeout=5).read().decode()
                break
            except OSError:
                if time.monotonic() > deadline:
                    return {"error": "node_exporter did not start"}
                time.sleep(0.05)
        series = sum(1 for line in body.splitlines() if line.startswith("node_infiniband_"))
        for _ in range(20):
            urllib.request.urlopen(url, timeout=5).read()
        ticks = os.sysconf("SC_CLK_TCK")

        def cpu() -> float:
            with open(f"/proc/{proc.pid}/stat", encoding="ascii") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / ticks

        c0 = cpu()
        for _ in range(runs):
            urllib.request.urlopen(url, timeout=5).read()
        return {"cpu_seconds_per_scrape": (cpu() - c0) / runs, "infiniband_series": series,
                "version": _version(binary)}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True)
    lines = (out.stdout or out.stderr).splitlines()
    return lines[0] if lines else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="nd-h100-v5")
    parser.add_argument("--ports", type=int, default=None, help="IB devices (an0 is extra)")
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--no-node-exporter", action="store_true",
                        help="skip the side-by-side run of node_exporter's infiniband collector")
    args = parser.parse_args()
    result: dict[str, object] = {
        "profile": args.profile, "runs": args.runs, "python": platform.python_version(),
        "machine": platform.machine(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        fabric = build_tree(args.profile, tmp + "/sys", ports=args.ports)
        result["ports"] = len(fabric.port_keys)
        for mode in ("pread", "open"):
            ctx = Context("bench", sysfs_root=tmp + "/sys", state_dir=tmp + "/state")
            ib = InfinibandCollector(ctx, Section("infiniband", {"read_mode": mode}))
            series = sum(len(f.samples) for f in ib.collect().families)
            result[f"infiniband_{mode}"] = {**per_run(ib.collect, args.runs), "series": series}
            ib.close()
            watcher = LinkflapCollector(ctx, Section("linkflap", {"read_mode": mode}))
            stats = per_run(watcher.collect, args.runs)
            stats["core_fraction_at_1s"] = stats["cpu_seconds_median"] / 1.0
            stats["series"] = sum(len(f.samples) for f in watcher.collect().families)
            result[f"linkflap_{mode}"] = stats
            watcher.close()
        if not args.no_node_exporter:
            ne = node_exporter(tmp + "/sys", args.runs)
            if ne is not None:
                result["node_exporter"] = ne
                per_scrape = ne.get("cpu_seconds_per_scrape")
                if isinstance(per_scrape, float) and per_scrape > 0:
                    # gpumon's cost per scrape is one collector run; its page is pre-rendered.
                    result["ratio_gpumon_to_node_exporter"] = (
                        result["infiniband_pread"]["cpu_seconds_median"] / per_scrape)  # type: ignore[index]
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
