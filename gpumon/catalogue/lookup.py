"""Reading a declaration's sink hints: what the sinks ask of a :class:`~gpumon.model.MetricSpec`.

The spec is the only source: nothing here is keyed by metric name, so a spec made again under a
built-in's name without hints is mapped like any unhinted metric.
"""

from __future__ import annotations

from dataclasses import replace

from gpumon.catalogue.hints import AzureHint, OtelMetric
from gpumon.model import MetricSpec


def otel_hints(spec: MetricSpec) -> tuple[OtelMetric, ...]:
    """The OpenTelemetry metrics ``spec`` names beside its declaration; () when it names none (the
    sink derives a name mechanically)."""
    return tuple(spec.otel)


def azure_hints(spec: MetricSpec) -> tuple[AzureHint, ...]:
    """The Azure hints of ``spec``, each naming it (``metric``); () when it has none (generic rows),
    and for a name that is not gpumon's: a plugin's metric cannot add columns to the deployed tables."""
    if spec.azure and owns_columns(spec.name):
        return tuple(h if h.metric else replace(h, metric=spec.name) for h in spec.azure)
    return ()


def owns_columns(name: str) -> bool:
    """Whether a metric may have columns of its own: the DCR template is generated from gpumon's
    declarations, so only gpumon's names (``gpumon_``, ``process_``) can have deployed columns."""
    return name.startswith(("gpumon_", "process_"))
