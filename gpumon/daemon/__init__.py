"""The loop and what runs it (``gpumon run`` and ``gpumon once``).

- :mod:`~gpumon.daemon.context`: the host (hostname, the collectors' Context, a simulated host, the
  sinks' SinkContext);
- :mod:`~gpumon.daemon.plan`: which collectors (probed), stages and sinks run;
- :mod:`~gpumon.daemon.loop`: every collector on its own thread, one composer of Snapshots that runs
  them through the stages (:mod:`gpumon.stages`);
- :mod:`~gpumon.daemon.once`: every collector run once, for ``gpumon once`` and ``gpumon check``;
- :mod:`~gpumon.daemon.health`: the health stage and what it learns from the host;
- :mod:`~gpumon.daemon.reload`: the Daemon, which builds, launches and reloads a set-up;
- :mod:`~gpumon.daemon.listen_file`: where ``gpumon run`` says which address it got (``--listen :0``).

The names below are the package's public face: the face, the tests and the benchmarks import them
from ``gpumon.daemon``.
"""

from __future__ import annotations

from gpumon.daemon.context import host_state_dir, hostname, make_context, simulation_dir, sink_context
from gpumon.daemon.health import health_stage, with_imds
from gpumon.daemon.loop import CollectorRunner, Loop, log_event, run_collect
from gpumon.daemon.once import collect_once
from gpumon.daemon.plan import (
    Plan,
    PlannedCollector,
    StartupError,
    collector_deadline,
    make_sinks,
    plan_collectors,
)
from gpumon.daemon.reload import CARRIED_ACROSS_RELOAD, Daemon

__all__ = [
    "CARRIED_ACROSS_RELOAD",
    "CollectorRunner",
    "Daemon",
    "Loop",
    "Plan",
    "PlannedCollector",
    "StartupError",
    "collect_once",
    "collector_deadline",
    "health_stage",
    "with_imds",
    "host_state_dir",
    "hostname",
    "log_event",
    "make_context",
    "make_sinks",
    "plan_collectors",
    "run_collect",
    "simulation_dir",
    "sink_context",
]
