"""``gpumon once``: every planned collector run once, in parallel, into one Snapshot."""

from __future__ import annotations

import threading
import time

from gpumon.collectors.base import Context
from gpumon.config import Config
from gpumon.daemon.loop import CollectorRunner, Loop, run_collect
from gpumon.daemon.plan import Plan
from gpumon.health.stage import HealthStage
from gpumon.model import Snapshot


def collect_once(config: Config, plan: Plan, ctx: Context, timeout: float | None = None,
                 health: HealthStage | None = None) -> Snapshot:
    """``gpumon once``: every running collector once, in parallel, each bounded by its deadline."""
    loop = Loop(config, plan, ctx, [], health=health)
    threads = []
    start = time.monotonic()
    for runner in loop.runners:
        def run(r: CollectorRunner = runner) -> None:
            t0 = time.monotonic()
            result, failure, unavailable = run_collect(r.collector)
            loop.accept(r, result, failure, unavailable, time.monotonic() - t0)

        thread = threading.Thread(target=run, name=f"once-{runner.name}", daemon=True)
        thread.start()
        threads.append((runner, thread))
    for runner, thread in threads:  # deadlines run from the common start, not one after another
        limit = timeout if timeout is not None else runner.deadline
        thread.join(max(0.0, start + limit - time.monotonic()))
        if thread.is_alive():
            runner.overran = True
            loop.mark_down(runner.name, f"run exceeded its {limit:g} s deadline", limit, "deadline")
    snapshot = loop.compose()
    for runner, thread in threads:
        if not thread.is_alive():
            runner.collector.close()
    return snapshot
