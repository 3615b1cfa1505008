"""Which collectors and sinks run: ``auto`` and explicit names resolved, implied collectors added,
each collector probed on a thread of its own, each sink built from its section."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from gpumon import registry
from gpumon.collectors.base import Collector, Context
from gpumon.config import Config
from gpumon.health.stage import HealthStage
from gpumon.model import StateReason
from gpumon.sinks.base import Sink, SinkContext
from gpumon.stages import AttributionRelabel, HealthJudging, SelfMetrics, Stage

log = logging.getLogger("gpumon.daemon")


class StartupError(Exception):
    """A collector or sink that was asked for cannot run: ``gpumon run`` exits 1 with this message."""


@dataclass
class PlannedCollector:
    name: str
    collector: Collector | None
    explicit: bool
    available: bool
    reason: str = ""
    #: Not available yet but its source is on this host (driver loading): ``run`` starts it anyway,
    #: reported down until its source is ready.
    waiting: bool = False
    #: Why it is not available, for ``gpumon_collector_state``.
    cause: StateReason = StateReason.ERROR


@dataclass
class Plan:
    """Which collectors run, decided from the config and each collector's probe."""

    collectors: list[PlannedCollector] = field(default_factory=list)

    @property
    def running(self) -> list[PlannedCollector]:
        return [p for p in self.collectors if p.available or p.waiting]

    def problems(self) -> list[str]:
        return [f"collector '{p.name}' is unavailable: {p.reason}"
                for p in self.collectors if p.explicit and not p.available]


def plan_collectors(config: Config, ctx: Context) -> Plan:
    """Resolve ``auto``, explicit names and implied collectors, then probe each. ``config``: the one
    in effect, ``ctx.config`` for a context ``make_context`` made (``--simulate`` applied there)."""
    wanted = list(config.daemon.collectors)
    auto = "auto" in wanted
    explicit = [n for n in wanted if n != "auto"]
    known = registry.available_collectors()
    for name in explicit:
        if name not in known:
            raise StartupError(f"unknown collector '{name}' (known: {', '.join(known)})")
    names = list(dict.fromkeys((known if auto else []) + explicit))
    classes: dict[str, type[Collector] | str] = {}
    i = 0
    while i < len(names):  # implied collectors join the run, after the one that implies them
        try:
            cls = classes[names[i]] = registry.collector_class(names[i])
        except registry.BrokenPlugin as exc:
            classes[names[i]] = f"cannot be loaded: {exc}"
        else:
            names.extend(n for n in cls.implies if n not in names and n in known)
        i += 1
    plan = Plan()
    for name in names:
        found = classes[name]
        if isinstance(found, str):
            plan.collectors.append(PlannedCollector(name, None, name in explicit, False, found))
            continue
        collector = found(ctx, config.sections.get(name))
        available, reason, finished, retry, cause = _probe(collector, collector_deadline(config, collector))
        waiting = not available and finished and retry
        if not (available or waiting) and finished:
            collector.close()  # a probe still hanging in a library call keeps its collector
        plan.collectors.append(PlannedCollector(name, collector if available or waiting else None,
                                                name in explicit, available, reason, waiting, cause))
    return plan


def collector_deadline(config: Config, collector: Collector) -> float:
    """``[daemon] deadline``, or the collector's interval (at least 1 s)."""
    interval = collector.interval(float(config.daemon.interval))
    return float(config.daemon.deadline) or max(interval, 1.0)


def _probe(collector: Collector, deadline: float) -> tuple[bool, str, bool, bool, StateReason]:
    """Probe on a thread of its own: a library that hangs at init (nvmlInit on a wedged GPU) must
    not keep the daemon from binding its port. Returns (available, reason, finished, retry, cause)."""
    answer: list[tuple[bool, str, bool, StateReason]] = []

    def probe() -> None:
        try:
            availability = collector.probe()
            answer.append((bool(availability.available), availability.reason, bool(availability.retry),
                           StateReason(availability.cause)))
        except Exception as exc:  # a probe must not raise; if it does, it is this collector's problem
            log.debug("probe of collector %s raised", collector.name, exc_info=True)
            answer.append((False, f"probe failed: {type(exc).__name__}: {exc}", False, StateReason.ERROR))

    thread = threading.Thread(target=probe, name=f"probe-{collector.name}", daemon=True)
    thread.start()
    thread.join(deadline)
    if not answer:
        return False, f"probe did not answer within {deadline:g} s", False, False, StateReason.DEADLINE_EXCEEDED
    available, reason, retry, cause = answer[0]
    return available, reason, True, retry, cause


def make_sinks(config: Config, ctx: SinkContext) -> list[Sink]:
    sinks = []
    for name in config.daemon.sinks:
        try:
            cls = registry.sink_class(name)
        except registry.UnknownPlugin:
            raise StartupError(f"unknown sink '{name}' (known: {', '.join(registry.available_sinks())})") from None
        except registry.BrokenPlugin as exc:
            raise StartupError(f"sink '{name}' cannot be loaded: {exc}") from None
        if cls.missing_dependencies():
            raise StartupError(f"sink '{name}' needs: pip install 'gpumon-exporter[{cls.extra}]'")
        cls.validate(config)
        sinks.append(cls(ctx, config.sections.get(name)))
    return sinks


def make_stages(config: Config, health: HealthStage | None, refresh: float) -> list[Stage]:
    """The steps after collection, in order: the health verdict on the collectors' series (judged
    again at most every ``refresh`` seconds while the runs bring the same series), the attribution
    labels on every per-GPU series (the verdict's too), then the self-metrics."""
    stages: list[Stage] = []
    if health is not None:
        stages.append(HealthJudging(health, unchanged_every=refresh))
    attribution = config.sections.get("attribution")
    if attribution is not None and attribution["labels"]:
        stages.append(AttributionRelabel())
    stages.append(SelfMetrics())
    return stages


def close_plan(plan: Plan) -> None:
    for planned in plan.collectors:
        if planned.collector is not None:
            planned.collector.close()
