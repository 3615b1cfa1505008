"""A simulated host's collectors run by hand and composed into Snapshots as the loop would.

For tests that need several consecutive snapshots of one simulated host (``collect_once`` closes
its collectors after one run) and the fault controls of its :class:`gpumon.simulate.Simulation`.
"""

from __future__ import annotations

import os
import time

from gpumon import registry
from gpumon.collectors.base import Context
from gpumon.model import CollectorStatus, MetricFamily, Snapshot
from gpumon.simulate import Simulation

COLLECTORS = ("nvml", "xid", "infiniband", "linkflap")


class SimulatedHost:
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
