"""Snapshots as OTLP metrics and events as OTLP log records, encoded straight into the protobuf
messages (imported on first use) with the snapshot's own timestamp."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gpumon.model import Event, Severity, Snapshot
from gpumon.sinks.otel import mapping

if TYPE_CHECKING:
    pass


log = logging.getLogger("gpumon.sinks.otel")


def pb_modules() -> Any:
    """The OTLP protobuf modules, imported on first use."""
    from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
    from opentelemetry.proto.common.v1 import common_pb2
    from opentelemetry.proto.logs.v1 import logs_pb2
    from opentelemetry.proto.metrics.v1 import metrics_pb2
    from opentelemetry.proto.resource.v1 import resource_pb2

    class PB:
        common = common_pb2
        metrics = metrics_pb2
        logs = logs_pb2
        resource = resource_pb2
        metrics_service = metrics_service_pb2
        logs_service = logs_service_pb2

    return PB


def _any_value(pb: Any, value: Any) -> Any:
    common = pb.common
    if isinstance(value, bool):
        return common.AnyValue(bool_value=value)
    if isinstance(value, int) and -(1 << 63) <= value < (1 << 63):
        return common.AnyValue(int_value=value)
    if isinstance(value, float):
        return common.AnyValue(double_value=value)
    if isinstance(value, (list, tuple)):
        return common.AnyValue(array_value=common.ArrayValue(values=[_any_value(pb, v) for v in value]))
    if isinstance(value, Mapping):
        return common.AnyValue(kvlist_value=common.KeyValueList(
            values=[common.KeyValue(key=str(k), value=_any_value(pb, v)) for k, v in value.items()]))
    if isinstance(value, bytes):
        return common.AnyValue(bytes_value=value)
    return common.AnyValue(string_value=str(value))


def _kvs(pb: Any, attrs: Mapping[str, Any] | tuple[tuple[str, Any], ...]) -> list[Any]:
    items = attrs.items() if isinstance(attrs, Mapping) else attrs
    return [pb.common.KeyValue(key=k, value=_any_value(pb, v)) for k, v in items]


Attrs = tuple[tuple[str, Any], ...]


def _points(otel: mapping.OtelMetric, attrs: Attrs, value: float) -> list[tuple[Attrs, float]]:
    """The data points one sample becomes: one, or one per ``hw.state`` for a status, or one per
    ``cpu.mode`` for the process's CPU time (the Prometheus value sums user and system time; the split
    is read from the process itself, which is the process that value describes)."""
    if otel.kind in (mapping.Kind.STATUS, mapping.Kind.STATUS_INVERTED):
        up = 1.0 if (value >= 1) == (otel.kind is mapping.Kind.STATUS) else 0.0
        return [(attrs + (("hw.state", "ok"),), up), (attrs + (("hw.state", "failed"),), 1 - up)]
    if otel.cpu_modes:
        times = os.times()
        return [(attrs + (("cpu.mode", "user"),), times.user), (attrs + (("cpu.mode", "system"),), times.system)]
    return [(attrs, value)]


class MetricEncoder:
    """Snapshot -> ExportMetricsServiceRequest. Keeps what must survive between exports: the start
    time of every cumulative series (reset when its value goes down) and per-series attributes."""

    def __init__(self, version: str) -> None:
        self.pb_modules = pb_modules()
        self._version = version
        self._starts: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[int, float, int]] = {}
        self._resolved: dict[Any, tuple[mapping.OtelMetric, ...]] = {}

    def encode(self, snapshot: Snapshot, resource: Mapping[str, str]) -> tuple[Any, int]:
        """The request and the number of data points in it."""
        pb = self.pb_modules
        now_ns = int(snapshot.time * 1e9)
        identity = mapping.Identity.from_families(
            (fam.name, (dict(s.labels) for s in fam.samples))
            for fam in snapshot.families
            if fam.name in (mapping.GPU_INFO, mapping.IB_PORT_INFO)
        )
        metrics: dict[str, Any] = {}
        points = 0
        seen: set[tuple[str, tuple[tuple[str, Any], ...]]] = set()
        for fam in snapshot.families:
            routes = self._resolved.get(fam.spec)
            if routes is None:
                routes = self._resolved[fam.spec] = mapping.routes(fam.spec)
            for otel in routes:
                points += self._encode_family(fam, otel, identity, metrics, seen, now_ns)
        request = pb.metrics_service.ExportMetricsServiceRequest()
        rm = request.resource_metrics.add()
        rm.resource.attributes.extend(_kvs(pb, resource))
        sm = rm.scope_metrics.add()
        sm.scope.name = "gpumon"
        sm.scope.version = self._version
        sm.metrics.extend(metrics.values())
        if len(self._starts) > 4 * max(points, 1024):  # series that went away for good
            self._starts = {k: v for k, v in self._starts.items() if v[2] == now_ns}
        return request, points

    def _encode_family(self, fam: Any, otel: mapping.OtelMetric, identity: mapping.Identity,
                       metrics: dict[str, Any], seen: set[tuple[str, tuple[tuple[str, Any], ...]]],
                       now_ns: int) -> int:
        """Add the samples of ``fam`` that ``otel`` takes to its metric; return the points added."""
        pb = self.pb_modules
        metric = metrics.get(otel.name)
        if metric is None:
            metric = pb.metrics.Metric(name=otel.name, unit=otel.unit, description=otel.description or fam.spec.help)
            if otel.kind is mapping.Kind.GAUGE:
                metric.gauge.SetInParent()
            else:
                metric.sum.aggregation_temporality = pb.metrics.AGGREGATION_TEMPORALITY_CUMULATIVE
                metric.sum.is_monotonic = otel.kind is mapping.Kind.COUNTER
            metrics[otel.name] = metric
        target = metric.gauge.data_points if otel.kind is mapping.Kind.GAUGE else metric.sum.data_points
        points = 0
        for sample in fam.samples:
            labels = dict(sample.labels)
            if not otel.takes(labels):
                continue
            for point_attrs, value in _points(otel, mapping.attributes(otel, labels, identity), sample.value):
                key = (otel.name, point_attrs)
                if key in seen:  # two Prometheus series on one OTel series: keep the first
                    continue
                seen.add(key)
                point = target.add(time_unix_nano=now_ns, as_double=value)
                point.attributes.extend(_kvs(pb, point_attrs))
                if otel.kind is not mapping.Kind.GAUGE:
                    point.start_time_unix_nano = self._start(key, value, now_ns, otel.kind is mapping.Kind.COUNTER)
                points += 1
        if not target:  # nothing of this family went to this name (yet): no empty metric on the wire
            del metrics[otel.name]
        return points

    def _start(self, key: tuple[str, tuple[tuple[str, str], ...]], value: float, now_ns: int,
               monotonic: bool) -> int:
        """The series' start time. gpumon does not know when a counter began counting, so the first
        point of a series, and the first after a counter went down, is an unknown-start reset point
        (start == time, zero duration: no rate contribution, per the metrics data model); later points
        keep that start. A made-up earlier start would put the whole lifetime value into one interval,
        which a cumulative-to-delta step turns into a spike at every gpumon restart."""
        known = self._starts.get(key)
        start = now_ns if known is None or (monotonic and value < known[1]) else known[0]
        self._starts[key] = (start, value, now_ns)
        return start


SEVERITY_NUMBER = {Severity.INFO: 9, Severity.WARNING: 13, Severity.ERROR: 17, Severity.CRITICAL: 21}


def event_name(event: Event) -> str:
    return f"gpumon.{event.kind}"


def event_attributes(event: Event) -> dict[str, Any]:
    """A log record's attributes: the event name and kind, the subject (with hw.id / hw.type where it
    names a GPU or a port), then the event's own attributes. ``event.name`` repeats the record's
    EventName for receivers built on an opentelemetry-proto that predates that field (it drops the field
    when decoding, and a record without its name is just a log line)."""
    subject = dict(event.subject)
    attrs: dict[str, Any] = {"event.name": event_name(event), "gpumon.event.kind": event.kind}
    if subject.get("uuid") or ("gpu" in subject and "device" not in subject):
        attrs["hw.type"] = "gpu"
        attrs["hw.id"] = subject.get("uuid") or f"gpu{subject['gpu']}"
    elif "device" in subject and "port" in subject:
        attrs["hw.type"] = "network"
        attrs["hw.id"] = f"{subject['device']}:{subject['port']}"
    attrs.update(subject)
    if "gpu" in subject:  # the pod, container and job holding it, in the conventions' names
        attrs.update(mapping.holder_attributes(event.attributes))
    for key, value in event.attributes.items():
        if not ("gpu" in subject and key in mapping.HOLDER_LABELS):
            attrs.setdefault(str(key), value)
    return attrs


def log_record_has_event_name() -> bool:
    """Whether the installed LogRecord class has ``event_name`` (opentelemetry-proto 1.35 and later;
    the extra allows older ones, whose classes refuse the keyword)."""
    return "event_name" in pb_modules().logs.LogRecord.DESCRIPTOR.fields_by_name


def encode_logs(events: list[Event], resource: Mapping[str, str], version: str,
                with_event_name: bool | None = None) -> Any:
    """Events -> ExportLogsServiceRequest. ``with_event_name``: set the LogRecord's EventName field;
    None asks the installed classes. Either way the name also travels as the ``event.name`` attribute."""
    pb = pb_modules()
    if with_event_name is None:
        with_event_name = log_record_has_event_name()
    request = pb.logs_service.ExportLogsServiceRequest()
    rl = request.resource_logs.add()
    rl.resource.attributes.extend(_kvs(pb, resource))
    sl = rl.scope_logs.add()
    sl.scope.name = "gpumon"
    sl.scope.version = version
    observed = time.time_ns()
    for event in events:
        record = sl.log_records.add(
            time_unix_nano=int(event.time * 1e9),
            observed_time_unix_nano=observed,
            severity_number=SEVERITY_NUMBER.get(event.severity, 9),
            severity_text=event.severity.value.upper(),
        )
        if with_event_name:
            record.event_name = event_name(event)
        record.body.string_value = event.message
        record.attributes.extend(_kvs(pb, event_attributes(event)))
    return request
