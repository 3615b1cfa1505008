"""Stand-ins for built-in metrics, mapped by the sinks as the real ones are."""

from __future__ import annotations

import dataclasses
import functools

from gpumon.model import MetricSpec


@functools.cache
def _declared() -> dict[str, MetricSpec]:
    from gpumon.confdoc import declared_specs

    return {spec.name: spec for spec in declared_specs()}


def hinted(spec: MetricSpec) -> MetricSpec:
    """``spec`` (a test's short stand-in for a built-in metric) with the sink hints gpumon's declaration
    of that name carries: the hints live on the declaration, so a bare spec made again by name has none."""
    declared = _declared()[spec.name]
    return dataclasses.replace(spec, otel=declared.otel, azure=declared.azure)
