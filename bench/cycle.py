"""Per-cycle overhead: what one collection cycle of a simulated ND H100 v5 costs beyond reading.

The daemon's own parts, built as ``gpumon run --simulate nd-h100-v5`` builds them at defaults (the
plan's collectors, the Prometheus sink, the health stage), run in this process without their
threads: each cycle every collector collects (its reading of sysfs and of the NVML double, *not*
timed), then the loop takes each result (``Loop.accept``) and publishes once (``Loop.publish_now``:
compose the snapshot, health rules, self-metrics, render the page). The thread CPU of those two
steps is the overhead (``time.thread_time``), median over the cycles; the part each step takes is
given beside it. The GPUs' values move every cycle (the double's workload), so the renderer cannot
keep the text of the GPU families read that cycle: this is the busy case (the NVML fields and GPM
metric read once every 30 s stand in between, as in the daemon). A part figure, labelled as one: the loop alone.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from bench.common import Options, median, rnd, say

TARGET_MS = 0.3


def _parts(tmp: str, profile: str, health: bool = True):
    from gpumon.cli import schemas
    from gpumon.config import load
    from gpumon.daemon.context import make_context, sink_context
    from gpumon.daemon.health import health_stage
    from gpumon.daemon.identity import identity_provider
    from gpumon.daemon.loop import Loop
    from gpumon.daemon.plan import make_sinks, plan_collectors
    from gpumon.stages import HealthJudging

    environ = {"GPUMON_DAEMON_STATE_DIR": os.path.join(tmp, "state"), "GPUMON_DAEMON_SIMULATE": profile}
    flags = {"listen": "127.0.0.1:0", "simulate": profile}
    empty = os.path.join(tmp, "gpumon.toml")  # defaults, whatever /etc/gpumon holds
    open(empty, "w").close()
    config = load(schemas(), empty, environ, flags)
    ctx = make_context(config)
    plan = plan_collectors(ctx.config, ctx)
    sinks = make_sinks(config, sink_context(ctx.config))
    identity = identity_provider(ctx.config, (p.name for p in plan.running), sinks) if health else None
    if identity is not None:
        identity.look()  # what the provider's thread has learnt by the daemon's first cycles
    loop = Loop(config, plan, ctx, sinks, None, health_stage(config, ctx) if health else None, identity)
    for stage in loop.stages:
        if isinstance(stage, HealthJudging):
            stage.every = 0.0  # every cycle is judged, as at the default 10 s interval
    return ctx, plan, sinks, loop


def overhead(opts: Options, profile: str = "nd-h100-v5", health: bool = True) -> dict[str, Any]:
    from gpumon.daemon.plan import close_plan

    cycles, warm = (3, 2) if opts.smoke else (300, 20)
    with tempfile.TemporaryDirectory(prefix="gpumon-bench-cycle-") as tmp:
        ctx, plan, sinks, loop = _parts(tmp, profile, health)
        try:
            sim = ctx.simulation
            accept, publish, collect = [], [], []
            for i in range(cycles + warm):
                if sim is not None:
                    sim.step(10.0)  # the workload moves: new GPU and IB values every cycle
                results = []
                t0 = time.thread_time()
                for runner in loop.runners:
                    started = time.monotonic()
                    results.append((runner, runner.collector.collect(), time.monotonic() - started))
                t1 = time.thread_time()
                for runner, result, duration in results:
                    loop.accept(runner, result, "", None, duration)
                t2 = time.thread_time()
                loop.publish_now()
                t3 = time.thread_time()
                if i >= warm:  # the first cycles fill caches (thresholds, the renderer's, health baselines)
                    collect.append(t1 - t0)
                    accept.append(t2 - t1)
                    publish.append(t3 - t2)
            page = sinks[0].page.body(False, False) if sinks and hasattr(sinks[0], "page") else b""
            series = sum(len(f.samples) for f in loop.latest.families) if loop.latest else 0
            total = [a + p for a, p in zip(accept, publish)]
        finally:
            close_plan(plan)
            if ctx.simulation is not None:
                ctx.simulation.stop()
    return {
        "profile": profile, "health_stage": health, "cycles": cycles, "collectors": [r.name for r in loop.runners],
        "series": series, "page_bytes": len(page),
        "overhead_ms_median": rnd(median(total) * 1e3), "accept_ms_median": rnd(median(accept) * 1e3),
        "publish_ms_median": rnd(median(publish) * 1e3),
        "reading_ms_median": rnd(median(collect) * 1e3),
        "target_ms": TARGET_MS, "target_met": median(total) * 1e3 <= TARGET_MS,
    }


def run(opts: Options) -> dict[str, Any]:
    """The issue's figure leaves the health stage out (snapshot, render, self-metrics, loop); what a
    user with ``[health]`` on (the default) pays is the second figure."""
    data = {"without_health": overhead(opts, health=False), "with_health": overhead(opts, health=True)}
    bare, full = data["without_health"], data["with_health"]
    say(opts, f"cycle: ND H100 v5 page ({bare['series']} series): {bare['overhead_ms_median']} ms per cycle beyond "
              f"reading (accept {bare['accept_ms_median']} + publish {bare['publish_ms_median']}; target <= "
              f"{TARGET_MS} ms); with the health stage {full['overhead_ms_median']} ms; reading itself "
              f"{bare['reading_ms_median']} ms")
    return data


if __name__ == "__main__":
    import json

    print(json.dumps(run(Options()), indent=1))
