"""The steps after collection, each ``(snapshot, books) -> snapshot``, run by the loop in the order
the plan builds them (:func:`gpumon.daemon.plan.make_stages`), as an OpenTelemetry Collector runs its
processors:

- :mod:`~gpumon.stages.health`: the health rules' verdict, judged at most every second;
- :mod:`~gpumon.stages.relabel`: ``[attribution] labels``, the holders' labels on per-GPU series;
- :mod:`~gpumon.stages.selfmetrics`: gpumon's metrics about itself, from the loop's bookkeeping.

A new stage is a class with a ``name`` and ``__call__(snapshot, books) -> snapshot`` in a module
here, placed in the list by ``make_stages``. See :mod:`~gpumon.stages.base` for why a stage also
sees ``books``.
"""

from __future__ import annotations

from gpumon.stages.base import Books, CollectorBook, Stage, run_stages
from gpumon.stages.health import HealthJudging
from gpumon.stages.relabel import AttributionRelabel
from gpumon.stages.selfmetrics import SelfMetrics

__all__ = ["AttributionRelabel", "Books", "CollectorBook", "HealthJudging", "SelfMetrics", "Stage", "run_stages"]
