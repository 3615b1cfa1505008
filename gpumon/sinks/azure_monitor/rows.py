"""Snapshots -> Log Analytics rows: the column table, the interval aggregation, the event rows.

The custom tables have a *fixed* set of columns (a DCR stream declaration cannot grow at run time), so
the columns a metric fills are the ``azure`` hint on its declaration (:mod:`gpumon.catalogue`).
``deploy/azure/generate.py`` builds the template's ``streamDeclarations`` from :func:`stream_columns`
over every declared metric (:func:`gpumon.confdoc.declared_specs`), and a test checks that the
committed template equals the generated one: the code and the deployed schema cannot drift apart.
A test lists the collectors' per-GPU and per-port metrics that have no hint.

Aggregations per metric (a column suffix each):
- ``min``/``avg``/``max`` (``...Min``, ``...Avg``, ``...Max``): over the interval's samples;
- ``last`` (the bare name for a gauge, ``...Total`` for a counter): the last value seen;
- ``increase`` (``...Increase``): a counter's growth over the interval; a decrease is a reset (driver
  reload, ``perfquery -R``) and the new value counts from zero;
- ``rate`` (``...PerSecond``): ``increase`` over the seconds it was measured across;
- ``flag`` (a boolean, bare name): last value non-zero.
A metric with labels beyond the row's identity (an NVLink ``link``, an ECC ``type``) is either split
into one column per listed label value (``split``) or, without ``split``, summed over them.

Who held a GPU (``Namespace``, ``Pod``, ``Container``, ``JobId``) comes from the snapshots'
``gpumon_gpu_allocation_info``: every holder seen during the interval, comma-joined in the same order
in all four columns. The copies ``[attribution] labels = true`` makes of a per-GPU series are one
series here, never summed twice.
"""

from __future__ import annotations

import datetime as _dt
import logging
import math
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpumon import attribution_labels
from gpumon.catalogue.hints import (
    EVENTS,
    GPU,
    IB,
    METRICS,
    AzureHint,
    InfoColumns,
    MetricColumns,
)
from gpumon.catalogue.lookup import azure_hints
from gpumon.model import AzureInstance, Event, MetricFamily, MetricSpec, MetricType, Snapshot

log = logging.getLogger("gpumon.sinks.azure_monitor")

TABLES = {GPU: "GpuMonGpu_CL", IB: "GpuMonInfiniBand_CL", EVENTS: "GpuMonEvents_CL", METRICS: "GpuMonMetrics_CL"}
DEFAULT_STREAMS = {key: f"Custom-{table}" for key, table in TABLES.items()}


IDENTITY = {GPU: (("gpu", "Gpu", "int"), ("uuid", "Uuid", "string")),
            IB: (("device", "Device", "string"), ("port", "Port", "int"))}
"""Per table: (label, column, type) that make a series belong to one row."""

HOST_COLUMNS: tuple[tuple[str, str], ...] = (
    ("vm_id", "VmId"), ("vm_size", "VmSize"), ("region", "Region"), ("zone", "Zone"), ("vmss", "Vmss"),
    ("placement_group", "PlacementGroup"), ("fault_domain", "FaultDomain"), ("physical_host", "PhysicalHost"))
"""The Azure VM and its placement (``gpumon_host_info``'s label -> column), on the rows of all three
tables: IMDS vmId, vmSize, location, zone, vmScaleSetName, placementGroupId, platformFaultDomain, and
the KVP pool's PhysicalHostName; left out where unknown."""
COMMON_COLUMNS: tuple[tuple[str, str], ...] = (
    ("TimeGenerated", "datetime"),
    ("Computer", "string"),
    ("RowId", "string"),
    *((column, "string") for _, column in HOST_COLUMNS),
)
INTERVAL_COLUMNS: tuple[tuple[str, str], ...] = (("IntervalSeconds", "real"), ("Samples", "int"))
HOLDER_COLUMNS: tuple[tuple[str, str], ...] = (
    ("namespace", "Namespace"), ("pod", "Pod"), ("container", "Container"), ("job_id", "JobId"))
"""Attribution label -> column, on GPU rows and GPU event rows (comma-joined when several hold it)."""
EVENT_COLUMNS: tuple[tuple[str, str], ...] = (
    ("Kind", "string"), ("Severity", "string"), ("Message", "string"), ("Subject", "dynamic"),
    ("Attributes", "dynamic"), ("Gpu", "int"), ("Uuid", "string"), ("Device", "string"), ("Port", "int"),
    ("Collector", "string"), *((column, "string") for _, column in HOLDER_COLUMNS), ("FaultCode", "string"),
)

GENERIC_COLUMNS: tuple[tuple[str, str], ...] = (
    ("Name", "string"), ("MetricType", "string"), ("Unit", "string"), ("Labels", "dynamic"), ("Value", "real"),
    ("Min", "real"), ("Avg", "real"), ("Max", "real"), ("Increase", "real"))
"""GpuMonMetrics_CL: one row per series of a metric without columns of its own (a plugin's, a new
one) per interval: its name, type, unit and labels, the last value, and min/avg/max (gauges) or the
increase (counters) over the interval."""


def column_hints(specs: Iterable[MetricSpec]) -> tuple[AzureHint, ...]:
    """The Azure hints the given specs carry, each once, in the order of the specs' names (so that the
    generated schema does not depend on the order the specs were listed in)."""
    out: dict[AzureHint, None] = {}
    for spec in sorted(specs, key=lambda s: s.name):
        out.update(dict.fromkeys(azure_hints(spec)))
    return tuple(out)


def stream_columns(specs: Iterable[MetricSpec] = ()) -> dict[str, list[tuple[str, str]]]:
    """Table key -> ordered (column, type) list: the one source for the streamDeclarations.

    ``specs``: the declared metrics (``deploy/azure/generate.py`` passes every built-in one); their
    Azure hints give the GPU and port tables their metric columns, after the fixed ones, the info
    columns first and then each metric's, by metric name."""
    hints = column_hints(specs)
    metric_columns = [h for h in hints if isinstance(h, MetricColumns)]
    info_columns = [h for h in hints if isinstance(h, InfoColumns)]
    out: dict[str, list[tuple[str, str]]] = {}
    for table in (GPU, IB):
        cols = list(COMMON_COLUMNS) + list(INTERVAL_COLUMNS)
        cols += [(col, typ) for _, col, typ in IDENTITY[table]]
        if table == GPU:
            cols += [(col, "string") for _, col in HOLDER_COLUMNS]
        seen = {c for c, _ in cols}
        for info in info_columns:
            if info.table == table:
                for _, col in info.labels:
                    if col not in seen:
                        cols.append((col, "string"))
                        seen.add(col)
        for mapping in metric_columns:
            if mapping.table == table:
                for col, typ in mapping.column_names():
                    if col in seen:
                        raise ValueError(f"column {col} of {TABLES[table]} defined twice")
                    cols.append((col, typ))
                    seen.add(col)
        out[table] = cols
    out[EVENTS] = list(COMMON_COLUMNS) + list(EVENT_COLUMNS)
    out[METRICS] = list(COMMON_COLUMNS) + list(INTERVAL_COLUMNS) + list(GENERIC_COLUMNS)
    return out


# -- values ---------------------------------------------------------------------------------------


def iso_time(ts: float) -> str:
    """UTC ISO 8601 with milliseconds, the form Log Analytics parses for a datetime column."""
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _num(value: float, derived: bool = False, digits: int = 6) -> float | int | None:
    """Compact JSON numbers: integral values as ints, derived ones to ``digits`` significant digits.

    Gauge statistics and rates keep 6 digits (telemetry, not accounting); increases 9; a counter's
    last value is exact."""
    if value is None:
        return None
    value = float(value)  # samples built by hand may carry ints; bools become 0/1
    if not math.isfinite(value):
        return None
    if derived:
        value = float(f"{value:.{digits}g}")
    if value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


def _int_or_none(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None


@dataclass
class _Series:
    """One series' interval statistics; the counter baseline survives from interval to interval."""

    n: int = 0
    lo: float = math.inf
    hi: float = -math.inf
    total: float = 0.0
    last: float = math.nan
    increase: float = 0.0
    base_time: float | None = None
    last_time: float = 0.0

    def add(self, value: float, counter: bool, when: float) -> None:
        if counter:
            if self.base_time is None:
                self.base_time = when
            elif value >= self.last:
                self.increase += value - self.last
            else:  # a reset: the counter restarted from zero
                self.increase += value
        self.n += 1
        self.lo = min(self.lo, value)
        self.hi = max(self.hi, value)
        self.total += value
        self.last = value
        self.last_time = when

    def restart(self) -> None:
        """Start the next interval: keep the last value and time as the counter baseline."""
        self.n, self.lo, self.hi, self.total, self.increase = 0, math.inf, -math.inf, 0.0, 0.0
        if self.base_time is not None:
            self.base_time = self.last_time


@dataclass
class _Row:
    identity: tuple[str, ...]
    info: dict[str, str] = field(default_factory=dict)
    static_sent: dict[str, Any] = field(default_factory=dict)
    static_time: float | None = None
    series: dict[tuple[MetricColumns, str, tuple], _Series] = field(default_factory=dict)


class RowBuilder:
    """Folds snapshots into per-GPU and per-port interval rows, and turns events into rows.

    Not thread-safe: the sink calls it from the loop's thread only.
    """

    def __init__(self, computer: str, omit_zero_increases: bool = True, static_every: float = 3600.0,
                 generic: bool = True) -> None:
        self.computer = computer
        self.static_every = static_every
        """Seconds between rows that repeat unchanged static columns (info labels, limits, sizes);
        0 puts them on every row. A change is always sent at once."""
        self.omit_zero_increases = omit_zero_increases
        """Leave out ``...Increase`` columns that are 0: most error counters never move, and KQL's
        sum() reads a missing value as nothing added (use coalesce(x, 0) to show zeros)."""
        self.vm: dict[str, str] = {}
        """The host's facts by ``HOST_COLUMNS`` key (:func:`host_values`), from the identity the
        loop stamps on each snapshot; the sink swaps the whole dict."""
        self._rows: dict[str, dict[tuple[str, ...], _Row]] = {GPU: {}, IB: {}}
        self._seen: dict[str, MetricFamily] = {}
        self._snapshots = 0
        self._unmapped: set[str] = set()
        self.unmapped_count = 0
        """Families seen without columns of their own (each logged once): ``gpumon_sink_unmapped_metrics``."""
        self.generic = generic
        """Send those families as GpuMonMetrics_CL rows (off: logged and counted only)."""
        self._generic: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[MetricFamily, _Series]] = {}
        self._allocation: MetricFamily | None = None
        self._holders: dict[str, dict[attribution_labels.Holding, None]] = {}
        """Per GPU index: who held it during the interval, in the order first seen."""
        self.build_errors = 0

    @property
    def unmapped(self) -> set[str]:
        """Metric names seen that have no columns of their own: sent as generic rows (the other sinks
        export them as they do every metric)."""
        return set(self._unmapped)

    def add(self, snapshot: Snapshot, when: float) -> None:
        """Fold one snapshot in; ``when`` is a monotonic time for rates."""
        self._snapshots += 1
        self._allocation = snapshot.family(attribution_labels.ALLOCATION_FAMILY)
        self._add_holders(self._allocation)
        for fam in snapshot.families:
            # The loop hands the same family object again while a collector has not run anew;
            # counting it twice would weigh that collector's samples in min/avg/max.
            if self._seen.get(fam.name) is fam:
                continue
            self._seen[fam.name] = fam
            hints = azure_hints(fam.spec)
            for hint in hints:
                if isinstance(hint, MetricColumns):
                    self._add_metric(hint, fam, when)
                elif isinstance(hint, InfoColumns):
                    self._add_info(hint, fam)
            if hints:
                continue  # columns of its own, or NoColumns: deliberately not sent
            if fam.name != attribution_labels.ALLOCATION_FAMILY:
                self._add_generic(fam, when)

    def _add_generic(self, fam: MetricFamily, when: float) -> None:
        """A family without columns: logged once, counted, and folded into generic rows per series."""
        if fam.name not in self._unmapped:
            self._unmapped.add(fam.name)
            self.unmapped_count += 1
            log.info("azure_monitor: %s has no columns of its own; %s", fam.name,
                     f"sent as generic {TABLES[METRICS]} rows" if self.generic else
                     "not sent ([azure_monitor] stream_metrics is empty)")
        if not self.generic:
            return
        counter = fam.spec.type is MetricType.COUNTER
        for sample in fam.samples:
            key = (fam.name, sample.labels)
            entry = self._generic.get(key)
            if entry is None:
                entry = self._generic[key] = (fam, _Series())
            elif entry[0] is not fam:
                entry = self._generic[key] = (fam, entry[1])
            entry[1].add(sample.value, counter, when)

    def _add_holders(self, allocation: MetricFamily | None) -> None:
        """Remember who holds each GPU now (no allocation family: nobody holds any)."""
        for gpu, held in attribution_labels.holders(allocation).by_gpu.items():
            self._holders.setdefault(gpu, {}).update(dict.fromkeys(held))

    def _row(self, table: str, labels: Mapping[str, str]) -> _Row | None:
        ident = tuple(labels.get(label, "") for label, _, _ in IDENTITY[table])
        if not ident[0]:
            return None
        rows = self._rows[table]
        row = rows.get(ident)
        if row is None:
            row = rows[ident] = _Row(ident)
        return row

    def _add_metric(self, mapping: MetricColumns, fam: MetricFamily, when: float) -> None:
        counter = fam.spec.type is MetricType.COUNTER
        ident_labels = {label for label, _, _ in IDENTITY[mapping.table]} | set(attribution_labels.LABELS)
        done: set[tuple[int, tuple[MetricColumns, str, tuple]]] = set()
        for sample in fam.samples:
            labels = dict(sample.labels)
            if mapping.where and any(labels.get(k) != v for k, v in mapping.where):
                continue
            row = self._row(mapping.table, labels)
            if row is None:
                continue
            if mapping.split:
                infix = dict(mapping.split).get(labels.get(mapping.split_label, ""))
                if infix is None:
                    continue
                base = mapping.column + infix
                skip = ident_labels | {mapping.split_label} | {k for k, _ in mapping.where}
                extra = tuple(sorted((k, v) for k, v in labels.items() if k not in skip))
            else:
                base = mapping.column
                extra = tuple(sorted((k, v) for k, v in labels.items() if k not in ident_labels))
            key = (mapping, base, extra)
            if (id(row), key) in done:
                continue  # another holder's copy of a series already counted (attribution labels)
            done.add((id(row), key))
            series = row.series.get(key)
            if series is None:
                series = row.series[key] = _Series()
            series.add(sample.value, counter, when)

    def _add_info(self, info: InfoColumns, fam: MetricFamily) -> None:
        names = dict(info.labels)
        for sample in fam.samples:
            labels = dict(sample.labels)
            row = self._row(info.table, labels)
            if row is None:
                continue
            for label, value in labels.items():
                column = names.get(label)
                if column is not None and value:
                    row.info[column] = value

    def close_interval(self, wall_time: float, seconds: float) -> dict[str, list[dict[str, Any]]]:
        """The rows of the interval that ends now; statistics restart, counter baselines stay."""
        out: dict[str, list[dict[str, Any]]] = {GPU: [], IB: [], METRICS: self._generic_rows(wall_time, seconds)}
        for table in (GPU, IB):
            for row in list(self._rows[table].values()):
                try:
                    built = self._build(table, row, wall_time, seconds)
                except (TypeError, ValueError, OverflowError) as exc:  # one odd series costs one row
                    self.build_errors += 1
                    if self.build_errors == 1:
                        log.error("azure_monitor: cannot build a %s row for %s: %s", TABLES[table],
                                  "/".join(row.identity), exc)
                    built = None
                if built is not None:
                    out[table].append(built)
                for series in row.series.values():
                    series.restart()
        self._snapshots = 0
        self._holders = {}
        self._add_holders(self._allocation)
        return out

    def _generic_rows(self, wall_time: float, seconds: float) -> list[dict[str, Any]]:
        """The interval's GpuMonMetrics_CL rows; a series not seen for a whole interval is forgotten."""
        rows = []
        for key, (fam, series) in list(self._generic.items()):
            if not series.n:
                del self._generic[key]
                continue
            try:
                row = self._common(wall_time)
                row.update(IntervalSeconds=_num(seconds, derived=True), Samples=series.n, Name=fam.name,
                           MetricType=fam.spec.type.value, Unit=fam.spec.unit, Labels=dict(key[1]),
                           Value=_num(series.last))
                if fam.spec.type is MetricType.COUNTER:
                    row["Increase"] = _aggregate("increase", [series])
                else:
                    row.update(Min=_aggregate("min", [series]), Avg=_aggregate("avg", [series]),
                               Max=_aggregate("max", [series]))
                rows.append({k: v for k, v in row.items() if v is not None})
            except (TypeError, ValueError, OverflowError) as exc:  # one odd series costs one row
                self.build_errors += 1
                if self.build_errors == 1:
                    log.error("azure_monitor: cannot build a %s row for %s: %s", TABLES[METRICS], fam.name, exc)
            series.restart()
        return rows

    def _common(self, wall_time: float) -> dict[str, Any]:
        row: dict[str, Any] = {"TimeGenerated": iso_time(wall_time), "Computer": self.computer,
                               "RowId": str(uuid.uuid4())}
        vm = self.vm
        for key, column in HOST_COLUMNS:
            if vm.get(key):
                row[column] = vm[key]
        return row

    def _build(self, table: str, row: _Row, wall_time: float, seconds: float) -> dict[str, Any] | None:
        if not any(s.n for s in row.series.values()):
            return None  # nothing seen for this GPU/port in the interval (gone, or collector down)
        out = self._common(wall_time)
        out["IntervalSeconds"] = _num(seconds, derived=True)
        out["Samples"] = max(s.n for s in row.series.values())
        for (_label, column, typ), value in zip(IDENTITY[table], row.identity):
            out[column] = _int_or_none(value) if typ == "int" else value
        if table == GPU:
            out.update(_holder_columns(attribution_labels.joined(self._holders.get(row.identity[0], {}))))
        static: dict[str, Any] = dict(row.info)
        groups: dict[tuple[MetricColumns, str], list[_Series]] = {}
        for (mapping, base, _extra), series in row.series.items():
            if series.n:
                groups.setdefault((mapping, base), []).append(series)
        for (mapping, base), members in groups.items():
            for agg in mapping.aggs:
                value = _aggregate(agg, members)
                if value is None or (agg == "increase" and value == 0 and self.omit_zero_increases):
                    continue
                (static if mapping.static else out)[mapping._name(base, agg)] = value
        due = row.static_time is None or wall_time - row.static_time >= self.static_every
        if due or static != row.static_sent:
            row.static_sent, row.static_time = static, wall_time
            out.update(static)
        return out

    def event_row(self, event: Event) -> dict[str, Any]:
        row = self._common(event.time)
        subject = {str(k): str(v) for k, v in event.subject.items()}
        row.update({
            "Kind": event.kind,
            "Severity": event.severity.value,
            "Message": event.message,
            "Subject": subject,
            "Attributes": _jsonable(event.attributes),
        })
        for label, column, typ in (("gpu", "Gpu", "int"), ("uuid", "Uuid", "string"),
                                   ("device", "Device", "string"), ("port", "Port", "int"),
                                   ("collector", "Collector", "string")):
            if label in subject:
                value = _int_or_none(subject[label]) if typ == "int" else subject[label]
                if value is not None:
                    row[column] = value
        row.update(_holder_columns(event.attributes))
        codes = event.attributes.get("fault_codes")
        if isinstance(codes, (list, tuple)) and codes:  # health_changed: AzNHC codes of the findings
            row["FaultCode"] = ",".join(str(c) for c in codes)
        return row


def host_values(instance: AzureInstance | None, physical_host: str = "") -> dict[str, str]:
    """``RowBuilder.vm`` from IMDS's answer (None: none) and the KVP pool's physical host."""
    out = {"physical_host": physical_host}
    if instance is not None:
        out.update(vm_id=instance.vm_id, vm_size=instance.vm_size, region=instance.location,
                   zone=instance.zone, vmss=instance.vmss_name, placement_group=instance.placement_group_id,
                   fault_domain=instance.platform_fault_domain)
    return {k: v for k, v in out.items() if v}


def _holder_columns(values: Mapping[str, Any]) -> dict[str, str]:
    """Namespace, Pod, Container, JobId from attribution labels (``attribution_labels.joined``)."""
    return {column: str(values[label]) for label, column in HOLDER_COLUMNS if values.get(label)}


def _aggregate(agg: str, members: list[_Series]) -> Any:
    if agg == "min":
        return _num(min(s.lo for s in members), derived=True)
    if agg == "max":
        return _num(max(s.hi for s in members), derived=True)
    if agg == "avg":
        return _num(sum(s.total / s.n for s in members) / len(members), derived=True)
    if agg == "last":
        return _num(sum(s.last for s in members))
    if agg == "flag":
        return any(s.last != 0 for s in members)
    if agg == "increase":
        if all(s.base_time is None for s in members):
            return None
        return _num(sum(s.increase for s in members), derived=True, digits=9)
    if agg == "rate":
        total = 0.0
        measured = False
        for s in members:
            if s.base_time is not None and s.last_time > s.base_time:
                total += s.increase / (s.last_time - s.base_time)
                measured = True
        return _num(total, derived=True) if measured else None
    raise ValueError(f"unknown aggregation {agg!r}")  # pragma: no cover - table bug


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return str(value)
