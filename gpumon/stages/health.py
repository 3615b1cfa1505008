"""The health stage in the stage list: when to judge, and the verdict's series and events added.

The rules themselves (and their verdict, saved to disk) are :class:`gpumon.health.stage.HealthStage`;
this stage only decides when to ask them, so a fast collector does not pay the rules on every run.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from gpumon.health.stage import HealthStage
from gpumon.logs import log_event
from gpumon.model import Event, MetricFamily, Snapshot
from gpumon.stages.base import Books

log = logging.getLogger("gpumon.daemon")


class HealthJudging:
    """Judge the collectors' latest results and add the verdict's series and events.

    Judged only when a collector brought a new run, every collector has reported once, and not more
    often than ``every`` seconds (``unchanged_every`` when the runs brought the same series: the
    rules' windows and hold times move on). Between judgements the last verdict's series stay."""

    name = "health"

    def __init__(self, health: HealthStage, every: float = 1.0, unchanged_every: float = 5.0) -> None:
        self.health = health
        self.every = every
        """Seconds between evaluations when a collector's series changed (the watch interval)."""
        self.unchanged_every = unchanged_every
        """Seconds between evaluations of runs that changed nothing (the loop's REFRESH)."""
        self._seen: tuple[int, ...] | None = None
        self._at = -unchanged_every
        self._series: tuple[tuple[MetricFamily, ...], ...] = ()
        self._families: tuple[MetricFamily, ...] = ()

    def __call__(self, snapshot: Snapshot, books: Books) -> Snapshot:
        families, events = self._judge(snapshot) if self._due(books) else (self._families, ())
        if not families and not events:
            return snapshot
        return dataclasses.replace(snapshot, families=snapshot.families + families,
                                   events=snapshot.events + events)

    def _due(self, books: Books) -> bool:
        if not books.reported:
            return False  # no verdict before every collector has reported once
        if books.runs == self._seen:
            return False
        now = time.monotonic()
        same = len(books.series) == len(self._series) and all(
            a is b for a, b in zip(books.series, self._series))  # unchanged runs keep the shown tuple
        if now - self._at < (self.unchanged_every if same else self.every):
            books.owed = True  # judged on a later compose
            return False
        self._seen, self._at, self._series = books.runs, now, books.series
        return True

    def _judge(self, snapshot: Snapshot) -> tuple[tuple[MetricFamily, ...], tuple[Event, ...]]:
        """The rules' verdict on the collectors' latest results."""
        try:
            result = self.health.update(snapshot)
        except Exception:  # a rule bug must not stop the loop: the verdict goes stale, counted in the log
            log.exception("health: evaluating the rules failed")
            return self._families, ()
        for event in result.events:
            log_event(event)
        self._families = result.families
        return result.families, result.events
