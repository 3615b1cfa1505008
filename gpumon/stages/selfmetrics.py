"""gpumon's metrics about itself: build, collectors, sinks and the process (the last stage).

Kept apart from the loop so the loop stays about threads and time; this module only turns the loop's
bookkeeping (:class:`~gpumon.stages.base.Books`) into metric families.
"""

from __future__ import annotations

import dataclasses
import platform
import time
from collections.abc import Callable

from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import CollectorRegistry

from gpumon import __version__
from gpumon.catalogue.daemon import (
    BUILD_INFO,
    COLLECTOR_DURATION,
    COLLECTOR_ERRORS,
    COLLECTOR_RUNS,
    COLLECTOR_STATE,
    COLLECTOR_UP,
    CONFIG_RELOAD_OK,
    CONFIG_RELOADS,
    PROCESS_SPECS,
    SINK_DROPPED,
    SINK_EXPORTED,
    SINK_FAILED,
    SINK_GAUGES,
    SINK_UP,
    sink_gauge,
)
from gpumon.model import MetricFamily, MetricSpec, MetricType, Snapshot, StateReason
from gpumon.sinks.base import SinkHealth
from gpumon.stages.base import Books, CollectorBook

STATES = ("ok", "down", "unavailable")
REASONS = tuple(reason.value for reason in StateReason)
"""The ``reason`` values of gpumon_collector_state (given where a failure is raised); ``none`` goes
with ``ok``."""

_PROCESS_BY_NAME = {spec.name: spec for spec in PROCESS_SPECS}


PROCESS_EVERY = 5.0
"""Seconds between readings of the process_* metrics (/proc, a few hundred µs on a cold cache): the
loop may publish many times a second, and a CPU or memory figure fresher than the loop's REFRESH tells
a scraper (every 10 s or more) nothing more."""


class SelfMetrics:
    """The self-metrics stage: the loop's bookkeeping added as families, after every other stage
    (its families carry no GPU, so the attribution relabel would leave them as they are anyway)."""

    name = "self_metrics"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._build = MetricFamily(BUILD_INFO, (BUILD_INFO.sample(1, __version__, platform.python_version()),))
        registry = CollectorRegistry(auto_describe=False)
        self._process = ProcessCollector(registry=registry)
        self._process_specs: dict[str, MetricSpec] = {}
        self._clock = clock
        self._process_cache: tuple[float, list[MetricFamily]] | None = None

    def __call__(self, snapshot: Snapshot, books: Books) -> Snapshot:
        added = self.families(books.collectors, books.sinks, books.reloads, books.not_running)
        return dataclasses.replace(snapshot, families=snapshot.families + tuple(added))

    def families(self, collectors: dict[str, CollectorBook], sinks: dict[str, SinkHealth],
                 reloads: dict[str, int] | None = None,
                 not_running: dict[str, str] | None = None) -> list[MetricFamily]:
        """``not_running``: collectors the plan did not start, with their probe's cause (a REASONS value)."""
        names = sorted(collectors)
        out = [
            self._build,
            MetricFamily(COLLECTOR_UP, tuple(COLLECTOR_UP.sample(int(up), n)
                                            for n in names if (up := collectors[n].up) is not None)),
            MetricFamily(COLLECTOR_STATE, _states(collectors, not_running or {})),
            MetricFamily(COLLECTOR_DURATION,
                         tuple(COLLECTOR_DURATION.sample(collectors[n].duration, n) for n in names)),
            MetricFamily(COLLECTOR_RUNS, tuple(COLLECTOR_RUNS.sample(collectors[n].runs, n) for n in names)),
            MetricFamily(COLLECTOR_ERRORS, tuple(
                COLLECTOR_ERRORS.sample(count, n, reason)
                for n in names for reason, count in sorted(collectors[n].errors.items()))),
        ]
        if sinks:
            sink_names = sorted(sinks)
            out += [
                MetricFamily(SINK_UP, tuple(SINK_UP.sample(int(sinks[s].up), s) for s in sink_names)),
                MetricFamily(SINK_EXPORTED, tuple(SINK_EXPORTED.sample(sinks[s].exported, s) for s in sink_names)),
                MetricFamily(SINK_FAILED, tuple(SINK_FAILED.sample(sinks[s].failed, s) for s in sink_names)),
                MetricFamily(SINK_DROPPED, tuple(SINK_DROPPED.sample(sinks[s].dropped, s) for s in sink_names)),
            ]
            extras = sorted({key for s in sinks.values() for key in s.extra})
            for key in extras:
                spec = self._extra_spec(key)
                out.append(MetricFamily(spec, tuple(spec.sample(sinks[s].extra[key], s)
                                                    for s in sink_names if key in sinks[s].extra)))
        if reloads is not None:
            out.append(MetricFamily(CONFIG_RELOADS, tuple(CONFIG_RELOADS.sample(reloads.get(result, 0), result)
                                                          for result in ("failure", "success"))))
            out.append(MetricFamily(CONFIG_RELOAD_OK, (CONFIG_RELOAD_OK.sample(int(reloads.get("last_ok", 1))),)))
        out.extend(self._process_families())
        return [fam for fam in out if fam.samples]

    def _extra_spec(self, key: str) -> MetricSpec:
        name = f"gpumon_sink_{key}"
        spec = self._process_specs.get(name)
        if spec is None:
            spec = SINK_GAUGES.get(name) or sink_gauge(key)
            self._process_specs[name] = spec
        return spec

    def _process_families(self) -> list[MetricFamily]:
        """The process_* metrics, read again at most every PROCESS_EVERY seconds."""
        now = self._clock()
        cached = self._process_cache
        if cached is None or now - cached[0] >= PROCESS_EVERY or now < cached[0]:
            cached = self._process_cache = (now, self._read_process())
        return cached[1]

    def _read_process(self) -> list[MetricFamily]:
        """The process_* metrics prometheus-client computes from /proc, in gpumon's model."""
        out = []
        for metric in self._process.collect():
            for sample in metric.samples:
                spec = self._process_specs.get(sample.name)
                if spec is None:
                    kind = MetricType.COUNTER if sample.name.endswith("_total") else MetricType.GAUGE
                    declared = _PROCESS_BY_NAME.get(sample.name)  # gpumon's declaration: unit and hints
                    unit = declared.unit if declared else (
                        "seconds" if "seconds" in sample.name else ("bytes" if "bytes" in sample.name else ""))
                    spec = MetricSpec(sample.name, kind, metric.documentation, unit,
                                      otel=declared.otel if declared else (),
                                      azure=declared.azure if declared else ())
                    self._process_specs[sample.name] = spec
                out.append(MetricFamily(spec, (spec.sample(_clean(sample.name, sample.value)),)))
        return out


def _clean(name: str, value: float) -> float:
    """Seconds the client sums from clock ticks (utime + stime) carry float noise
    (0.13999999999999999); ticks are 10 ms, so microseconds keep every real digit. Done here, where
    the value is made, so the hot renderer keeps its plain ``repr``."""
    return round(value, 6) if name.endswith("_seconds") or name.endswith("_seconds_total") else value


def _states(collectors: dict[str, CollectorBook], not_running: dict[str, str]) -> tuple:
    """One gpumon_collector_state sample per collector, sorted by name; a running collector appears
    once its first run ends (as gpumon_collector_up does)."""
    rows = {name: (book.state, book.reason) for name, book in collectors.items() if book.state is not None}
    rows.update({name: ("unavailable", reason) for name, reason in not_running.items()})
    return tuple(COLLECTOR_STATE.sample(1, name, state, reason) for name, (state, reason) in sorted(rows.items()))
