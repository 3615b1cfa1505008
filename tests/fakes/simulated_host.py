"""A simulated host, two ways: :class:`SimulatedHost` runs its collectors by hand and composes
Snapshots as the loop would; :class:`SimulatedOnce` is ``gpumon once --simulate`` in process.

:class:`SimulatedHost` is for tests that need several consecutive snapshots of one simulated host
(``collect_once`` closes its collectors after one run) and the fault controls of its
:class:`gpumon.simulate.Simulation`; its snapshots hold the collectors' families only.
:class:`SimulatedOnce` goes through the daemon's config, plan and loop, so each snapshot is what the
sinks are handed (gpumon's own metrics included); each one is a fresh collection.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from gpumon import cli, config, daemon, registry
from gpumon.collectors.base import Context
from gpumon.model import CollectorStatus, MetricFamily, Snapshot
from gpumon.simulate import Simulation

COLLECTORS = ("nvml", "xid", "infiniband", "linkflap")


class SimulatedHost:
    """The collectors of ``profile`` on one simulated host, run by hand: ``snapshot()`` collects again."""

    def __init__(self, directory: str, profile: str = "nd-h100-v5", hostname: str = "nd-node",
                 collectors: tuple[str, ...] = COLLECTORS) -> None:
        self.sim = Simulation(profile, os.path.join(directory, "sim"))
        self.ctx = Context(hostname=hostname, sysfs_root=self.sim.sysfs_root,
                           state_dir=os.path.join(directory, "state"), simulation=self.sim, nvml=self.sim.nvml)
        os.makedirs(self.ctx.state_dir, exist_ok=True)
        self.hostname = hostname
        self.collectors = [registry.collector_class(name)(self.ctx, None) for name in collectors
                           if name in registry.available_collectors()]
        self.seq = 0

    def snapshot(self) -> Snapshot:
        families: list[MetricFamily] = []
        events = []
        statuses = []
        for collector in self.collectors:
            started = time.monotonic()
            result = collector.collect()
            families.extend(result.families)
            events.extend(result.events)
            statuses.append(CollectorStatus(collector.name, True, time.monotonic() - started))
        self.seq += 1
        return Snapshot(self.hostname, time.time(), tuple(families), tuple(events), tuple(statuses), self.seq)

    def close(self) -> None:
        for collector in self.collectors:
            collector.close()


class SimulatedOnce:
    """``gpumon once --simulate PROFILE`` in process, its state under ``state_dir``: each ``snapshot()``
    is a fresh collection through the daemon's plan and loop. ``environ`` is the environment the config
    is loaded from (the state directory is set in it); ``self.ctx.simulation`` takes control actions."""

    def __init__(self, state_dir: str, profile: str = "nd-h100-v5", environ: Mapping[str, str] | None = None) -> None:
        os.makedirs(state_dir, exist_ok=True)
        self.config = config.load(cli.schemas(), None, {**(environ or {}), "GPUMON_DAEMON_STATE_DIR": state_dir},
                                  {"simulate": profile})
        self.ctx = daemon.make_context(self.config)
        self.plan = daemon.plan_collectors(self.ctx.config, self.ctx)

    def snapshot(self) -> Snapshot:
        return daemon.collect_once(self.config, self.plan, self.ctx)
