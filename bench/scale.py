"""Scale: CPU per run and page size as the host grows, from one GPU to a 72-GPU rack as one host.

GPUs: 1, 8, 16 and 72 simulated H100s (the NVML double) through the NVML collector. Ports: 1, 9, 18
and 36 InfiniBand ports (the sysfs generator, ``plain-mlx5`` devices, one port each) through the
infiniband collector (pread) and the link-state watcher. CPU is ``time.process_time`` per run in
this process (median over many runs); the page is the collector's families rendered by gpumon's
renderer, with the render's own CPU (each the lowest of three medians). The slope is a least-squares
line through the four sizes; "linear or better" holds when the exponent k of a log-log fit
(cost ~ n^k) is at most 1.1.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from bench.common import Options, rnd, say, slope
from gpumon.collectors.base import Context
from gpumon.collectors.infiniband import InfinibandCollector
from gpumon.collectors.linkflap import LinkflapCollector
from gpumon.collectors.nvml import NvmlCollector
from gpumon.config import Section
from gpumon.model import MetricFamily
from gpumon.render import Renderer
from gpumon.simulate.nvml import FakeNVML
from gpumon.simulate.sysfs import build_tree

GPUS = (1, 8, 16, 72)
PORTS = (1, 9, 18, 36)
MAX_EXPONENT = 1.1
"""cost ~ n^k with k above this is worse than linear (the margin absorbs timing noise)."""


def cpu_per_run(collect: Callable[[], object], runs: int, rounds: int = 3) -> float:
    """The lowest of ``rounds`` medians: a neighbour's burst on a shared machine only ever adds."""
    best = float("inf")
    for _ in range(rounds):
        samples = []
        for _ in range(runs):
            c0 = time.process_time()
            collect()
            samples.append(time.process_time() - c0)
        best = min(best, statistics.median(samples))
    return best


def page(families: list[MetricFamily], runs: int) -> dict:
    renderer = Renderer()
    text = renderer.render(families).encode("utf-8")  # the first render fills the prefix cache
    cpu = cpu_per_run(lambda: renderer.render(families), runs)
    return {"series": sum(len(f.samples) for f in families), "page_bytes": len(text),
            "render_cpu_ms": rnd(cpu * 1e3)}


def fit(name: str, sizes: tuple[int, ...], rows: list[dict], key: str) -> dict:
    """The least-squares line (cost per unit) and the growth exponent k of cost ~ n^k (log-log fit)."""
    ys = [r[key] for r in rows]
    b, a = slope(list(sizes), ys)
    k, _ = slope([math.log(n) for n in sizes], [math.log(max(y, 1e-12)) for y in ys])
    return {"per_unit": rnd(b), "intercept": rnd(a), "unit": name, "exponent": rnd(k),
            "linear_or_better": k <= MAX_EXPONENT}


def run(opts: Options) -> dict:
    runs = 3 if opts.smoke else 30
    gpus = GPUS[:2] if opts.smoke else GPUS
    ports = PORTS[:2] if opts.smoke else PORTS
    result: dict = {"runs_per_point": runs, "gpus": [], "ports": []}
    with tempfile.TemporaryDirectory(prefix="gpumon-bench-scale-") as tmp:
        for n in gpus:
            ctx = Context("bench", state_dir=os.path.join(tmp, f"gpu-{n}"), nvml=FakeNVML("h100-sxm5-80gb", n))
            os.makedirs(ctx.state_dir, exist_ok=True)
            collector = NvmlCollector(ctx, None)
            try:
                collector.collect()  # init, static info, GPM baseline
                cpu = cpu_per_run(collector.collect, runs)
                families = collector.collect().families
            finally:
                collector.close()
            row = {"gpus": n, "cpu_ms_per_run": rnd(cpu * 1e3), **page(families, runs)}
            result["gpus"].append(row)
            say(opts, f"scale: {n:3} GPUs: {row['cpu_ms_per_run']} ms CPU/run, {row['series']} series, "
                      f"{row['page_bytes']} bytes, render {row['render_cpu_ms']} ms")
        for n in ports:
            sysfs = os.path.join(tmp, f"sys-{n}")
            build_tree("plain-mlx5", sysfs, ports=n)
            ctx = Context("bench", sysfs_root=sysfs, state_dir=os.path.join(tmp, f"ports-{n}"))
            os.makedirs(ctx.state_dir, exist_ok=True)
            ib = InfinibandCollector(ctx, Section("infiniband", {"read_mode": "pread"}))
            watcher = LinkflapCollector(ctx, Section("linkflap", {"read_mode": "pread"}))
            try:
                ib.collect()
                watcher.collect()
                cpu = cpu_per_run(ib.collect, runs)
                watch_cpu = cpu_per_run(watcher.collect, runs)
                families = ib.collect().families + watcher.collect().families
            finally:
                ib.close()
                watcher.close()
            row = {"ports": n, "cpu_ms_per_run": rnd(cpu * 1e3), "watcher_cpu_ms_per_run": rnd(watch_cpu * 1e3),
                   **page(families, runs)}
            result["ports"].append(row)
            say(opts, f"scale: {n:3} ports: {row['cpu_ms_per_run']} ms CPU/run (watcher {row['watcher_cpu_ms_per_run']}"
                      f" ms), {row['series']} series, {row['page_bytes']} bytes, render {row['render_cpu_ms']} ms")
    if len(gpus) > 2:
        result["slope_per_gpu"] = {
            "cpu_ms_per_run": fit("GPU", gpus, result["gpus"], "cpu_ms_per_run"),
            "series": fit("GPU", gpus, result["gpus"], "series"),
            "page_bytes": fit("GPU", gpus, result["gpus"], "page_bytes"),
            "render_cpu_ms": fit("GPU", gpus, result["gpus"], "render_cpu_ms"),
        }
        result["slope_per_port"] = {
            "cpu_ms_per_run": fit("port", ports, result["ports"], "cpu_ms_per_run"),
            "watcher_cpu_ms_per_run": fit("port", ports, result["ports"], "watcher_cpu_ms_per_run"),
            "series": fit("port", ports, result["ports"], "series"),
            "page_bytes": fit("port", ports, result["ports"], "page_bytes"),
            "render_cpu_ms": fit("port", ports, result["ports"], "render_cpu_ms"),
        }
        result["linear_or_better"] = all(f["linear_or_better"] for group in ("slope_per_gpu", "slope_per_port")
                                         for f in result[group].values())
        g, p = result["slope_per_gpu"], result["slope_per_port"]
        say(opts, f"scale: slope {g['cpu_ms_per_run']['per_unit']} ms CPU and {g['page_bytes']['per_unit']:.0f} bytes "
                  f"per GPU; {p['cpu_ms_per_run']['per_unit']} ms CPU and {p['page_bytes']['per_unit']:.0f} bytes "
                  f"per port; linear or better: {result['linear_or_better']}")
    return result
