"""What a stage is: a step after collection that turns the snapshot being composed into the next.

A stage is called as ``stage(snapshot, books) -> snapshot``, as an OpenTelemetry Collector processor
takes a batch and hands on a batch. ``snapshot`` is a :class:`~gpumon.model.Snapshot` whose
families are not yet merged (the loop merges once, after the last stage) and whose ``seq`` is not yet
given. ``books`` is what the loop counted about the collectors and sinks while composing: not part of
any snapshot (a sink never sees it), yet the health stage's rate limit and the self-metrics are made
from it, so a pure ``Snapshot -> Snapshot`` could not keep their behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from gpumon.model import MetricFamily, Snapshot
from gpumon.sinks.base import SinkHealth


@dataclass
class CollectorBook:
    """The loop's running totals for one collector."""

    up: bool | None = None
    """None until the first run ends, so a collector that has not run yet is not reported down."""
    duration: float = 0.0
    runs: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    state: str | None = None
    """One of ``selfmetrics.STATES`` once the first run ends."""
    reason: str = "none"
    """One of ``selfmetrics.REASONS``: why the collector is not ok."""

    def count(self, reason: str, n: int = 1) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + n

    def set_state(self, state: str, reason: str = "none") -> None:
        self.state, self.reason = state, reason


@dataclass
class Books:
    """The loop's bookkeeping at one compose, copied under its lock (the CollectorBooks are the
    loop's own, as the self-metrics always read them)."""

    collectors: dict[str, CollectorBook]
    """Every running collector's totals, by name."""
    runs: tuple[int, ...] = ()
    """Each running collector's run count, in plan order."""
    series: tuple[tuple[MetricFamily, ...], ...] = ()
    """Each running collector's latest series, in plan order: the very tuple again while its runs
    bring the same series, so a stage can tell "nothing changed" by identity."""
    reported: bool = True
    """Every running collector has ended one run."""
    sinks: dict[str, SinkHealth] = field(default_factory=dict)
    reloads: dict[str, int] | None = None
    not_running: dict[str, str] = field(default_factory=dict)
    """Collectors the plan did not start, with their probe's cause (a ``StateReason`` value)."""
    owed: bool = False
    """Set by a stage that put work off: the loop composes again within its SOFT seconds."""


class Stage(Protocol):
    """One step after collection (see the module's docstring)."""

    name: str

    def __call__(self, snapshot: Snapshot, books: Books) -> Snapshot: ...


def run_stages(stages: list[Stage], snapshot: Snapshot, books: Books) -> Snapshot:
    """``snapshot`` through every stage in order. An exception ends this compose (the loop logs it
    and composes again on its next wake); the health stage catches the rules' own failures."""
    for stage in stages:
        snapshot = stage(snapshot, books)
    return snapshot
