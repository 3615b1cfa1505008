"""The types of the hints a sink needs to map a metric, and helpers to write them short.

A metric is declared once, in the catalogue (:mod:`gpumon.catalogue`), as a
:class:`gpumon.model.MetricSpec`. What a sink needs beyond its name, type, unit, help and labels is a
*hint* on the same declaration:

- ``MetricSpec.otel``: the OpenTelemetry metric(s) it maps to (:class:`OtelMetric`), where a semantic
  convention or a better name applies; without one the OTel sink derives a name mechanically;
- ``MetricSpec.azure``: the Log Analytics columns it fills (:class:`MetricColumns`, :class:`InfoColumns`),
  or :class:`NoColumns` for a metric of gpumon's that deliberately has none; without any the Azure
  Monitor sink sends it as generic rows (``GpuMonMetrics_CL``: Name, Labels, Value).

:mod:`gpumon.catalogue.lookup` reads them. Pure data: this module imports nothing of gpumon, so that
:mod:`gpumon.model` can name these types on :class:`~gpumon.model.MetricSpec`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


# ------------------------------------------------------------------------------------ OpenTelemetry
class Kind(str, enum.Enum):
    """The OpenTelemetry instrument a metric is exported as."""

    GAUGE = "gauge"
    """Gauge data points."""
    COUNTER = "counter"
    """Cumulative, monotonic Sum."""
    UPDOWN = "updowncounter"
    """Cumulative, non-monotonic Sum (hw.gpu.memory.usage, hw.network.up ...)."""
    STATUS = "status"
    """A 0/1 health gauge exported as ``hw.status`` (non-monotonic Sum): one point per ``hw.state``."""
    STATUS_INVERTED = "status_inverted"
    """As STATUS, from a gauge that is 1 when the component failed (``gpumon_gpu_lost``)."""


class Domain(str, enum.Enum):
    """Which hardware component a series describes, so the right hw.* attributes are attached."""

    NONE = ""
    GPU = "gpu"
    GPU_TEMPERATURE = "gpu_temperature"
    """A GPU's temperature sensor (hw.type=temperature, hw.parent=the GPU)."""
    GPU_FAN = "gpu_fan"
    """A GPU's fan (hw.type=fan, hw.parent=the GPU)."""
    NETWORK = "network"
    PROCESS = "process"
    """The gpumon process itself (process.pid on the point)."""


@dataclass(frozen=True)
class OtelMetric:
    """The OpenTelemetry side of one Prometheus metric (or of the samples of it that ``select`` picks)."""

    name: str
    unit: str
    kind: Kind
    domain: Domain = Domain.NONE
    attributes: tuple[tuple[str, str], ...] = ()
    """Fixed attributes added to every point (``network.io.direction=receive``)."""
    label_map: tuple[tuple[str, str], ...] = ()
    """Prometheus label -> attribute name, for labels that have a convention (``xid`` -> ``error.type``)."""
    description: str = ""
    """Used instead of the spec's help where several Prometheus metrics share one OpenTelemetry name."""
    semconv: bool = False
    select: tuple[tuple[str, str], ...] = ()
    """Only samples with all these label values go to this metric; the labels are dropped (the name
    says them): ``engine=memory`` -> ``hw.gpu.memory.utilization``."""
    exclude: tuple[tuple[str, str], ...] = ()
    """Samples with any of these label values do not go to this metric (another route takes them)."""
    cpu_modes: bool = False
    """The Prometheus value sums user and system time; the sink sends one point per ``cpu.mode``."""

    def takes(self, labels: Mapping[str, str]) -> bool:
        """Whether a sample with these labels is exported under this metric."""
        if any(labels.get(k) != v for k, v in self.select):
            return False
        return not any(labels.get(k) == v for k, v in self.exclude)


RECEIVE = (("network.io.direction", "receive"),)
TRANSMIT = (("network.io.direction", "transmit"),)
"""Fixed ``attributes`` for the receive and transmit halves of one OpenTelemetry metric."""
ERRORS_DESCRIPTION = "Errors encountered by the hardware component."
STATUS_DESCRIPTION = "Operational status of the component, one point per hw.state."
"""The descriptions of ``hw.errors`` and ``hw.status``, which several Prometheus metrics share."""


# ------------------------------------------------------------------------------------ Azure Monitor
GPU, IB, EVENTS, METRICS = "gpu", "ib", "events", "metrics"
"""The Azure Monitor sink's tables: one row per GPU, per IB port, per event, and generic metric rows."""

AGG_MINMAX = ("min", "avg", "max")
AGG_COUNTER = ("increase", "last")
AGG_RATE = ("increase", "rate", "last")
AGG_LAST = ("last",)
AGG_FLAG = ("flag",)
"""Common ``MetricColumns.aggs``: a gauge's statistics, a counter's increase and last value (and its
rate), a gauge's last value, a boolean flag."""
_SUFFIX = {"min": "Min", "avg": "Avg", "max": "Max", "increase": "Increase", "rate": "PerSecond"}


@dataclass(frozen=True)
class MetricColumns:
    """How one metric becomes columns of one table."""

    metric: str
    table: str
    column: str
    aggs: tuple[str, ...]
    split: tuple[tuple[str, str], ...] = ()
    """(label value, column infix) pairs; with ``split_label`` set, one column group per value."""
    split_label: str = ""
    static: bool = False
    """Changes rarely (limits, sizes, maxima): sent when it changes and at least every ``static_every``."""
    where: tuple[tuple[str, str], ...] = ()
    """Only samples with these label values count (e.g. ECC's volatile counter, not the lifetime one)."""

    def column_names(self) -> list[tuple[str, str]]:
        """(column name, Log Analytics type) pairs this metric contributes."""
        bases = [self.column + infix for _, infix in self.split] if self.split else [self.column]
        out = []
        for base in bases:
            for agg in self.aggs:
                out.append((self._name(base, agg), "boolean" if agg == "flag" else "real"))
        return out

    def _name(self, base: str, agg: str) -> str:
        if agg == "flag":
            return base
        if agg == "last":
            if len(self.aggs) == 1:
                return base
            return base + "Total"
        return base + _SUFFIX[agg]


@dataclass(frozen=True)
class InfoColumns:
    """An ``_info`` metric whose labels become string columns of the row it describes."""

    metric: str
    table: str
    labels: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class NoColumns:
    """A metric of gpumon's that deliberately has no columns (per link, per process, per MIG instance:
    no fixed column can hold it), and why; it is not sent as generic rows either."""

    reason: str
    metric: str = ""


AzureHint = MetricColumns | InfoColumns | NoColumns
"""An Azure hint: columns of a GPU or port row (a metric), string columns from an ``_info`` metric,
or none on purpose."""


def camel(name: str) -> str:
    """``hw_thermal_slowdown`` -> ``HwThermalSlowdown``: a label value as a column name part."""
    return "".join(part[:1].upper() + part[1:] for part in name.split("_") if part)


def each(prefix: str, values: tuple[str, ...], suffix: str = "") -> tuple[tuple[str, str], ...]:
    """``split`` pairs for label values, each column named ``prefix + camel(value) + suffix``."""
    return tuple((v, prefix + camel(v) + suffix) for v in values)


def gpu_columns(column: str, aggs: tuple[str, ...] = AGG_MINMAX, **kw: Any) -> MetricColumns:
    """Columns of the per-GPU row (GpuMonGpu_CL) for the spec they are declared on."""
    return MetricColumns("", GPU, column, aggs, **kw)


def port_columns(column: str, aggs: tuple[str, ...] = AGG_COUNTER, **kw: Any) -> MetricColumns:
    """Columns of the per-port row (GpuMonInfiniBand_CL) for the spec they are declared on."""
    return MetricColumns("", IB, column, aggs, **kw)
