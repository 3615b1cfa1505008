"""The OpenTelemetry sink: snapshots as OTLP metrics, events as OTLP log records.

The values in a snapshot are already collected and already cumulative where they count, so the sink
does not run them through the SDK's instruments and aggregation (a second sampling clock that would
re-timestamp them). It encodes the snapshot straight into the OTLP protobuf messages, with the
snapshot's own timestamp, and sends them from its own threads over OTLP/HTTP (protobuf) or OTLP/gRPC:
one thread for metrics, one for logs, so a slow metrics export never delays an XID's log record.
``publish`` only swaps a reference and appends events to a bounded queue.

Nothing here imports protobuf, grpc or OpenTelemetry at module import: the registry imports this
module to read the class attributes, and a daemon without the ``otel`` sink must not pay for them.
"""

from __future__ import annotations

import collections
import gzip
import http.client
import logging
import os
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpumon.config import Option, SectionSchema
from gpumon.imds import IMDS_URL, AzureInstance, ImdsClient
from gpumon.model import Event, Severity, Snapshot
from gpumon.sinks import azure_host
from gpumon.sinks import otel_mapping as mapping
from gpumon.sinks.base import CheckResult, Sink, SinkContext, SinkHealth
from gpumon.sinks.common import (
    Backoff,
    DeliveryCounters,
    LogOnce,
    has_new_results,
    parse_retry_after,
    retry_after_from_headers,
)

if TYPE_CHECKING:
    from gpumon.config import Section

log = logging.getLogger("gpumon.sinks.otel")

HTTP_PROTOBUF = "http/protobuf"
GRPC = "grpc"
DEFAULT_HTTP_ENDPOINT = "http://localhost:4318"
DEFAULT_GRPC_ENDPOINT = "http://localhost:4317"
DEFAULT_TIMEOUT = 10.0
SIGNALS = ("metrics", "logs")


def _kv_list_check(value: list[str]) -> str | None:
    for item in value:
        if "=" not in item or not item.partition("=")[0].strip():
            return f"entries must be KEY=VALUE (got {item!r})"
    return None


OPTIONS = SectionSchema(
    "otel",
    "OTLP export of metrics (hardware semantic conventions) and events (log records). Every key left "
    "empty falls back to the standard OTEL_EXPORTER_OTLP_* variable; where both are set, this section wins.",
    (
        Option("endpoint", str, "",
               "Collector address. http/protobuf: base URL, `/v1/metrics` and `/v1/logs` are appended "
               "(like OTEL_EXPORTER_OTLP_ENDPOINT); grpc: `host:port` or `http(s)://host:port`. "
               "Empty: the OTEL_EXPORTER_OTLP_* variables, else localhost:4318 (http) / 4317 (grpc)."),
        Option("protocol", str, "", "`http/protobuf` or `grpc`; empty: OTEL_EXPORTER_OTLP_PROTOCOL, "
               "else http/protobuf.", choices=("", HTTP_PROTOBUF, GRPC)),
        Option("headers", list, [], "Extra request headers (gRPC metadata) as KEY=VALUE; merged over "
               "OTEL_EXPORTER_OTLP_HEADERS, this list winning per key.", check=_kv_list_check, secret=True),
        Option("compression", str, "", "`gzip` or `none`; empty: OTEL_EXPORTER_OTLP_COMPRESSION, else none.",
               choices=("", "gzip", "none")),
        Option("timeout", float, 0.0, "Seconds one export may take; 0: OTEL_EXPORTER_OTLP_TIMEOUT "
               "(milliseconds), else 10.", min=0.0, max=600.0),
        Option("insecure", bool, False, "gRPC without TLS for an endpoint given without a scheme "
               "(OTEL_EXPORTER_OTLP_INSECURE does the same). `http://` endpoints never use TLS."),
        Option("certificate", str, "", "CA bundle (PEM) that verifies the collector's certificate; "
               "empty: OTEL_EXPORTER_OTLP_CERTIFICATE, else the system store."),
        Option("client_certificate", str, "", "Client certificate (PEM) for mutual TLS."),
        Option("client_key", str, "", "Client private key (PEM) for mutual TLS."),
        Option("interval", float, 0.0, "Seconds between metric exports; 0 exports every new snapshot, "
               "so the export follows the collection interval.", min=0.0, max=3600.0),
        Option("resource_attributes", list, [], "Extra resource attributes as KEY=VALUE; they win over "
               "OTEL_RESOURCE_ATTRIBUTES and the detected ones.", check=_kv_list_check),
        Option("logs", bool, True, "Export events (flaps, XIDs, lost GPUs, collectors down) as log records."),
        Option("azure_detect", bool, True, "Ask Azure IMDS (the one `[azure]` configures) for cloud.* / "
               "host.* / placement, and the KVP pool for the physical host, on a background thread; the "
               "first export waits at most `[azure] imds_timeout` + 0.5 s for them. Off Azure nothing "
               "answers and nothing is added."),
        Option("imds_url", str, IMDS_URL, "Deprecated alias of `[azure] imds_url`, honoured when set (with "
               "a warning); empty switches IMDS detection off for this sink."),
        Option("imds_timeout", float, 1.0, "Deprecated alias of `[azure] imds_timeout`, honoured when set "
               "(with a warning).", min=0.05, max=30.0),
        Option("max_queued_records", int, 10000, "Log records kept while the collector is unreachable; "
               "beyond this the oldest are dropped (counted).", min=1, max=10_000_000),
        Option("backoff_initial", float, 1.0, "Seconds before the first retry after a failed export; "
               "doubles (with jitter) up to backoff_max.", min=0.01, max=600.0),
        Option("backoff_max", float, 60.0, "Longest wait between retries, in seconds.", min=0.01, max=3600.0),
    ),
)
IMDS_ALIASES = {"imds_url": "imds_url", "imds_timeout": "imds_timeout"}
"""This section's deprecated IMDS keys -> the ``[azure]`` keys they stand for."""


# --------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class SignalSettings:
    """Where and how one signal (metrics or logs) is sent, after config and environment are merged."""

    signal: str
    protocol: str
    endpoint: str
    """Full URL for http/protobuf; gRPC target (``host:port``) for grpc."""
    headers: tuple[tuple[str, str], ...]
    timeout: float
    compression: str
    tls: bool
    certificate: str = ""
    client_certificate: str = ""
    client_key: str = ""


def _parse_kv(items: list[str] | str, unquote: bool = False) -> dict[str, str]:
    """``["a=b", ...]`` or ``"a=b,c=d"`` (W3C baggage style, URL-encoded in the OTEL_* variables)."""
    if isinstance(items, str):
        items = [part for part in items.split(",") if part.strip()]
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            log.warning("otel: ignoring malformed KEY=VALUE item %r", item)
            continue
        key, value = key.strip(), value.strip()
        if unquote:
            key, value = urllib.parse.unquote(key), urllib.parse.unquote(value)
        if key:
            out[key] = value
    return out


def _env(environ: Mapping[str, str], signal: str, key: str) -> str:
    """OTEL_EXPORTER_OTLP_<SIGNAL>_<KEY>, else OTEL_EXPORTER_OTLP_<KEY>, else ''."""
    return (environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_{key}", "").strip()
            or environ.get(f"OTEL_EXPORTER_OTLP_{key}", "").strip())


def resolve_settings(cfg: Mapping[str, Any], signal: str, environ: Mapping[str, str]) -> SignalSettings:
    """Merge the [otel] section over the standard variables for one signal. Config wins where set."""
    protocol = cfg.get("protocol") or _env(environ, signal, "PROTOCOL") or HTTP_PROTOBUF
    if protocol not in (HTTP_PROTOBUF, GRPC):
        raise ValueError(f"otel protocol {protocol!r} is not supported (use {HTTP_PROTOBUF} or {GRPC})")

    if protocol == HTTP_PROTOBUF:
        path = f"/v1/{signal}"
        if cfg.get("endpoint"):
            endpoint = _signal_url(cfg["endpoint"], path)
        elif environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT", "").strip():
            endpoint = environ[f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"].strip()
        else:
            endpoint = _signal_url(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
                                   or DEFAULT_HTTP_ENDPOINT, path)
        scheme = urllib.parse.urlsplit(endpoint).scheme
        if scheme not in ("http", "https"):
            raise ValueError(f"otel endpoint {endpoint!r} must be an http:// or https:// URL")
        tls = scheme == "https"
    else:
        raw = cfg.get("endpoint") or _env(environ, signal, "ENDPOINT") or DEFAULT_GRPC_ENDPOINT
        parts = urllib.parse.urlsplit(raw if "://" in raw else "//" + raw)
        if not parts.hostname:
            raise ValueError(f"otel endpoint {raw!r} has no host")
        insecure_env = _env(environ, signal, "INSECURE").lower() in ("true", "1", "yes")
        if parts.scheme == "https":
            tls = True
        elif parts.scheme == "http":
            tls = False
        else:
            tls = not (cfg.get("insecure") or insecure_env)
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        endpoint = f"{host}:{parts.port or 4317}"

    headers = _parse_kv(_env(environ, signal, "HEADERS"), unquote=True)
    headers.update(_parse_kv(cfg.get("headers") or []))

    timeout = float(cfg.get("timeout") or 0.0)
    if not timeout:
        text = _env(environ, signal, "TIMEOUT")
        try:
            timeout = float(text) / 1000.0 if text else DEFAULT_TIMEOUT
        except ValueError:
            log.warning("otel: ignoring OTEL_EXPORTER_OTLP_TIMEOUT=%r (not a number of milliseconds)", text)
            timeout = DEFAULT_TIMEOUT
        if timeout <= 0:
            timeout = DEFAULT_TIMEOUT

    compression = (cfg.get("compression") or _env(environ, signal, "COMPRESSION") or "none").lower()
    if compression not in ("gzip", "none"):
        log.warning("otel: unsupported compression %r, sending uncompressed", compression)
        compression = "none"

    return SignalSettings(
        signal=signal,
        protocol=protocol,
        endpoint=endpoint,
        headers=tuple(headers.items()),
        timeout=timeout,
        compression=compression,
        tls=tls,
        certificate=cfg.get("certificate") or _env(environ, signal, "CERTIFICATE"),
        client_certificate=cfg.get("client_certificate") or _env(environ, signal, "CLIENT_CERTIFICATE"),
        client_key=cfg.get("client_key") or _env(environ, signal, "CLIENT_KEY"),
    )


def _signal_url(base: str, path: str) -> str:
    """Append ``/v1/<signal>`` to a base URL unless it already names a signal path."""
    base = base.rstrip("/")
    for known in ("/v1/metrics", "/v1/logs"):
        if base.endswith(known):
            base = base[: -len(known)]
            break
    return base + path


# --------------------------------------------------------------------------------------- resource


def azure_attributes(instance: AzureInstance | None, physical_host: str = "") -> dict[str, str]:
    """Resource attributes for an Azure VM: the cloud.* / host.* semantic conventions (``host.id`` the
    vmId, ``cloud.resource_id`` the ARM id), and its placement (the facts of ``gpumon_host_info``)
    under ``gpumon.azure.*``, which no convention names. Empty values are left out."""
    if instance is None:
        return {PHYSICAL_HOST: physical_host} if physical_host else {}
    attrs = {
        "cloud.provider": "azure",
        "cloud.platform": "azure.aks" if instance.aks else "azure.vm",
        "cloud.region": instance.location,
        "host.id": instance.vm_id,
        "host.type": instance.vm_size,
        "cloud.resource_id": instance.resource_id,
        "cloud.account.id": instance.subscription_id,
        "cloud.availability_zone": instance.zone,
        "azure.resource_group.name": instance.resource_group,
        "gpumon.azure.vmss": instance.vmss_name,
        "gpumon.azure.placement_group": instance.placement_group_id,
        "gpumon.azure.fault_domain": instance.platform_fault_domain,
        PHYSICAL_HOST: physical_host,
    }
    return {k: v for k, v in attrs.items() if v}


PHYSICAL_HOST = "gpumon.azure.physical_host"
"""The Hyper-V KVP pool's PhysicalHostName: what several VMs failing together may share."""


K8S_NODE_VARIABLES = ("K8S_NODE_NAME", "NODE_NAME")
"""Where a pod finds its node's name (set from the downward API's ``spec.nodeName``)."""


def kubernetes_attributes(environ: Mapping[str, str]) -> dict[str, str]:
    """``k8s.node.name`` in a pod: K8S_NODE_NAME or NODE_NAME, else GPUMON_DAEMON_HOSTNAME, which
    gpumon's DaemonSet sets from ``spec.nodeName``; nothing outside Kubernetes."""
    if not environ.get("KUBERNETES_SERVICE_HOST"):
        return {}
    for key in (*K8S_NODE_VARIABLES, "GPUMON_DAEMON_HOSTNAME"):
        if environ.get(key, "").strip():
            return {"k8s.node.name": environ[key].strip()}
    return {}


def resource_attributes(
    ctx: SinkContext,
    configured: list[str],
    environ: Mapping[str, str],
    detected: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Layers, later wins: gpumon's own (and k8s.node.name in a pod), detected (IMDS),
    OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME, the config's ``resource_attributes``."""
    attrs = {"service.name": "gpumon", "service.version": ctx.version, "host.name": ctx.hostname}
    attrs.update(kubernetes_attributes(environ))
    attrs.update(detected or {})
    attrs.update(_parse_kv(environ.get("OTEL_RESOURCE_ATTRIBUTES", ""), unquote=True))
    if environ.get("OTEL_SERVICE_NAME", "").strip():
        attrs["service.name"] = environ["OTEL_SERVICE_NAME"].strip()
    attrs.update(_parse_kv(configured))
    return {k: v for k, v in attrs.items() if v != ""}


# --------------------------------------------------------------------------------------- encoding


def _pb() -> Any:
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
        self._pb = _pb()
        self._version = version
        self._starts: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[int, float, int]] = {}
        self._resolved: dict[Any, tuple[mapping.OtelMetric, ...]] = {}

    def encode(self, snapshot: Snapshot, resource: Mapping[str, str]) -> tuple[Any, int]:
        """The request and the number of data points in it."""
        pb = self._pb
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
        pb = self._pb
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
    return "event_name" in _pb().logs.LogRecord.DESCRIPTOR.fields_by_name


def encode_logs(events: list[Event], resource: Mapping[str, str], version: str,
                with_event_name: bool | None = None) -> Any:
    """Events -> ExportLogsServiceRequest. ``with_event_name``: set the LogRecord's EventName field;
    None asks the installed classes. Either way the name also travels as the ``event.name`` attribute."""
    pb = _pb()
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


# --------------------------------------------------------------------------------------- transports


@dataclass
class SendResult:
    ok: bool
    retryable: bool = False
    detail: str = ""
    retry_after: float | None = None
    rejected: int = 0
    """Items the collector refused in a partial success."""
    throttled: bool = False
    """gRPC RESOURCE_EXHAUSTED without RetryInfo: not retryable by the OTLP specification (see
    ``THROTTLED_LOG_ATTEMPTS`` for what the logs queue does with it)."""


RETRYABLE_HTTP = (429, 502, 503, 504)
THROTTLED_LOG_ATTEMPTS = 3
"""Attempts a log batch gets when a gRPC collector answers RESOURCE_EXHAUSTED without RetryInfo.
The OTLP specification says to drop it (that answer is also what a message over the server's size
limit gets, which no retry fixes, and retrying it forever would hold every later event behind it);
an event is not resent by the next export the way a cumulative value is, so it gets a few tries with
backoff first. Metrics follow the specification: the next snapshot carries the same counters."""


class _Deadline:
    """Shuts one request's sockets down when its whole-request deadline passes.

    A socket timeout bounds each read, not the request: a server that trickles a byte now and then
    would hold an export (and every snapshot behind it) forever. The watchdog owns a duplicate of each
    socket, so shutting it down never touches a descriptor that was closed and reused meanwhile.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.expired = False
        self._done = False
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        """Take a duplicate of a freshly connected socket; shut it down at once if already late."""
        dup = sock.dup()
        with self._lock:
            if not self._done and not self.expired:
                self._socks.append(dup)
                return
        _shutdown(dup)
        dup.close()

    def _expire(self) -> None:
        with self._lock:
            if self._done:
                return
            self.expired = True
            for sock in self._socks:
                _shutdown(sock)

    def finish(self) -> None:
        """Stop the watchdog and release the duplicates (the request itself closes its socket)."""
        self._timer.cancel()
        with self._lock:
            self._done = True
            socks, self._socks = self._socks, []
        for sock in socks:
            sock.close()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed by the peer
        pass


def _watched(cls: type[http.client.HTTPConnection], deadline: _Deadline | None) -> Callable[..., Any]:
    """A connection factory for urllib whose sockets the request's deadline can shut down."""

    def make(*args: Any, **kwargs: Any) -> http.client.HTTPConnection:
        conn = cls(*args, **kwargs)
        if deadline is not None:
            # the stdlib's hook for the TCP connect: private, so typeshed does not declare it
            create = conn._create_connection  # type: ignore[attr-defined]

            def create_and_watch(*a: Any, **kw: Any) -> socket.socket:
                sock = create(*a, **kw)
                deadline.watch(sock)
                return sock

            conn._create_connection = create_and_watch  # type: ignore[attr-defined]
        return conn

    return make


class _DeadlineHTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(_watched(http.client.HTTPConnection, getattr(req, "deadline", None)), req)


class _DeadlineHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, context: ssl.SSLContext) -> None:
        super().__init__(context=context)
        self._tls = context

    def https_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(_watched(http.client.HTTPSConnection, getattr(req, "deadline", None)), req,
                            context=self._tls)


class HttpTransport:
    """OTLP/HTTP with binary protobuf bodies (stdlib only, one request per export, each bounded as a
    whole by the export timeout)."""

    def __init__(self, settings: SignalSettings, version: str) -> None:
        self.settings = settings
        self._headers = {
            "Content-Type": "application/x-protobuf",
            "User-Agent": f"gpumon/{version}",
            **dict(settings.headers),
        }
        if settings.compression == "gzip":
            self._headers["Content-Encoding"] = "gzip"
        handlers: list[Any] = [_DeadlineHTTPHandler()]
        if settings.tls:
            context = ssl.create_default_context(cafile=settings.certificate or None)
            if settings.client_certificate:
                context.load_cert_chain(settings.client_certificate, settings.client_key or None)
            handlers.append(_DeadlineHTTPSHandler(context))
        self._opener = urllib.request.build_opener(*handlers)

    def send(self, body: bytes, timeout: float | None = None) -> SendResult:
        if self.settings.compression == "gzip":
            body = gzip.compress(body, 6)
        request = urllib.request.Request(self.settings.endpoint, data=body, headers=self._headers, method="POST")
        seconds = timeout or self.settings.timeout
        deadline = request.deadline = _Deadline(seconds)  # type: ignore[attr-defined]
        try:
            with self._opener.open(request, timeout=seconds) as response:
                reply = response.read(1 << 20)
            if deadline.expired:  # shut down mid-body: a truncated reply is no answer
                raise TimeoutError
            return SendResult(True, rejected=_rejected(self.settings.signal, reply))
        except urllib.error.HTTPError as exc:
            retry_after = retry_after_from_headers(exc.headers)
            return SendResult(False, exc.code in RETRYABLE_HTTP, f"HTTP {exc.code} {exc.reason}", retry_after)
        except (OSError, ValueError, http.client.HTTPException) as exc:  # refused, reset, timeout, TLS, bad URL
            if deadline.expired:
                return SendResult(False, True, f"timed out: no complete answer within the {seconds:g} s deadline")
            reason = getattr(exc, "reason", exc)
            return SendResult(False, True, f"{type(reason).__name__}: {reason}")
        finally:
            deadline.finish()

    def close(self) -> None:
        pass


def _rejected(signal: str, reply: bytes) -> int:
    """Items refused in an OTLP partial success (an empty body is a full success)."""
    if not reply:
        return 0
    pb = _pb()
    try:
        if signal == "metrics":
            response = pb.metrics_service.ExportMetricsServiceResponse.FromString(reply)
            return int(response.partial_success.rejected_data_points)
        response = pb.logs_service.ExportLogsServiceResponse.FromString(reply)
        return int(response.partial_success.rejected_log_records)
    except Exception:  # noqa: BLE001 - a collector answering 200 with a non-OTLP body: count nothing
        return 0


class GrpcTransport:
    """OTLP/gRPC through the collector services' generated stubs."""

    RETRYABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "CANCELLED", "OUT_OF_RANGE", "DATA_LOSS")
    """The OTLP specification's retryable codes; RESOURCE_EXHAUSTED only when the server sends RetryInfo."""

    def __init__(self, settings: SignalSettings, version: str) -> None:
        import grpc

        self.settings = settings
        self._grpc = grpc
        options = [("grpc.primary_user_agent", f"gpumon/{version}")]
        compression = grpc.Compression.Gzip if settings.compression == "gzip" else grpc.Compression.NoCompression
        if settings.tls:
            def read(path: str) -> bytes | None:
                if not path:
                    return None
                with open(path, "rb") as fh:
                    return fh.read()

            credentials = grpc.ssl_channel_credentials(
                read(settings.certificate), read(settings.client_key), read(settings.client_certificate))
            self._channel = grpc.secure_channel(settings.endpoint, credentials, options, compression)
        else:
            self._channel = grpc.insecure_channel(settings.endpoint, options, compression)
        if settings.signal == "metrics":
            from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc

            self._call: Callable[..., Any] = metrics_service_pb2_grpc.MetricsServiceStub(self._channel).Export
        else:
            from opentelemetry.proto.collector.logs.v1 import logs_service_pb2_grpc

            self._call = logs_service_pb2_grpc.LogsServiceStub(self._channel).Export
        self._metadata = tuple((k.lower(), v) for k, v in settings.headers)

    def send_message(self, message: Any, timeout: float | None = None) -> SendResult:
        try:
            response = self._call(message, timeout=timeout or self.settings.timeout, metadata=self._metadata)
        except self._grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            name = getattr(code, "name", str(code))
            details = exc.details() if hasattr(exc, "details") else ""
            trailing = (exc.trailing_metadata() or ()) if hasattr(exc, "trailing_metadata") else ()
            retry_after = _grpc_retry_delay(trailing)
            if name == "RESOURCE_EXHAUSTED":
                if retry_after is None:  # no sign that the server will recover: the spec says drop
                    return SendResult(False, False, f"gRPC {name}: {details}", throttled=True)
                return SendResult(False, True, f"gRPC {name}: {details}", retry_after)
            return SendResult(False, name in self.RETRYABLE, f"gRPC {name}: {details}", retry_after)
        partial = response.partial_success
        rejected = partial.rejected_data_points if self.settings.signal == "metrics" else partial.rejected_log_records
        return SendResult(True, rejected=int(rejected))

    def close(self) -> None:
        self._channel.close()


def _grpc_retry_delay(trailing: Any) -> float | None:
    """Seconds the server asks the client to wait: google.rpc.RetryInfo in the status details
    (``grpc-status-details-bin``), else a ``retry-after`` trailer in seconds; None when neither."""
    delay = None
    for key, value in trailing:
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            info = _retry_info(value)
            if info is not None:
                return info
        elif key == "retry-after":
            delay = parse_retry_after(str(value))
    return delay


def _retry_info(status_details: bytes) -> float | None:
    """retry_delay of the RetryInfo in a serialized google.rpc.Status. The classes come with
    googleapis-common-protos (which ``gpumon-exporter[otel]`` installs); without them, or on a body that
    does not parse, the details are ignored."""
    try:
        from google.rpc import error_details_pb2, status_pb2
    except Exception:  # noqa: BLE001 - missing, or generated for another protobuf (TypeError)
        return None
    try:
        status = status_pb2.Status.FromString(status_details)
        for detail in status.details:
            info = error_details_pb2.RetryInfo()
            if detail.Unpack(info):
                return max(0.0, info.retry_delay.seconds + info.retry_delay.nanos / 1e9)
    except Exception:  # noqa: BLE001 - a malformed trailer is the same as none
        return None
    return None


def make_transport(settings: SignalSettings, version: str) -> Any:
    if settings.protocol == GRPC:
        return GrpcTransport(settings, version)
    return HttpTransport(settings, version)


def send(transport: Any, message: Any, timeout: float | None = None) -> SendResult:
    if isinstance(transport, GrpcTransport):
        return transport.send_message(message, timeout)
    return transport.send(message.SerializeToString(), timeout)


# --------------------------------------------------------------------------------------- the sink


class OtelSink(Sink):
    """OTLP metrics (hardware semantic conventions) and events as log records."""

    name = "otel"
    description = "OpenTelemetry OTLP export (http/protobuf or gRPC) of metrics and events."
    options = OPTIONS
    requires = ("google.protobuf", "opentelemetry.proto")
    extra = "otel"

    def __init__(self, ctx: SinkContext, cfg: Section | None = None, environ: Mapping[str, str] | None = None
                 ) -> None:
        super().__init__(ctx, cfg)
        self._opts: dict[str, Any] = OPTIONS.values(cfg)
        self._environ = os.environ if environ is None else environ
        self._lock = threading.Lock()
        self._wake_metrics = threading.Condition(self._lock)
        self._wake_logs = threading.Condition(self._lock)
        self._stopping = False
        self._latest: Snapshot | None = None
        self._events: collections.deque[tuple[int, Event]] = collections.deque()
        """Queued events with their sequence numbers (from 1), oldest first."""
        self._event_seq = 0
        self._in_flight = 0
        """Sequence number of the last event of the batch being sent; 0 when none is."""
        self._metrics = DeliveryCounters()
        self._logs = DeliveryCounters()
        self._resource: dict[str, str] = {}
        self._resource_ready = threading.Event()
        self._imds: ImdsClient | None = None
        self._threads: list[threading.Thread] = []
        self._settings: dict[str, SignalSettings] = {}
        self._started = False
        self._log_once = LogOnce(log)

    # -- lifecycle

    def _resolve(self) -> dict[str, SignalSettings]:
        signals = SIGNALS if self._opts["logs"] else ("metrics",)
        return {s: resolve_settings(self._opts, s, self._environ) for s in signals}

    def start(self) -> None:
        self.ensure_dependencies()
        self._settings = self._resolve()
        if any(s.protocol == GRPC for s in self._settings.values()):
            try:
                import grpc  # noqa: F401
            except ImportError as exc:
                raise RuntimeError("otel protocol grpc needs grpcio: pip install 'gpumon-exporter[otel]'") from exc
        _pb()  # fail start-up now, not on the first export, if the protobuf classes do not load
        self._resource = resource_attributes(self.ctx, self._opts["resource_attributes"], self._environ)
        if self._opts["azure_detect"]:
            self._imds = azure_host.imds_client(self.ctx, self.name, self.cfg, OPTIONS, IMDS_ALIASES)
        if self._imds is not None:
            threading.Thread(target=self._detect_azure, name="otel-imds", daemon=True).start()
        else:
            self._resource_ready.set()
        self._threads = [threading.Thread(target=self._metrics_loop, name="otel-metrics", daemon=True)]
        if "logs" in self._settings:
            self._threads.append(threading.Thread(target=self._logs_loop, name="otel-logs", daemon=True))
        self._started = True
        for thread in self._threads:
            thread.start()
        where = ", ".join(f"{s.signal} -> {s.endpoint}" for s in self._settings.values())
        log.info("otel: exporting over %s (%s)", self._settings["metrics"].protocol, where)

    def _detect_azure(self) -> None:
        """Once, at start: the resource identifies the exporter, it does not follow it around."""
        try:
            found = azure_host.facts(self._imds, azure_host.kvp_pool(self.ctx))
            detected = azure_attributes(found.instance, found.physical_host)
            if detected:
                with self._lock:
                    self._resource = resource_attributes(
                        self.ctx, self._opts["resource_attributes"], self._environ, detected)
            if found.instance is not None:
                log.info("otel: on Azure (%s, %s)", detected.get("host.type", "?"),
                         detected.get("cloud.region", "?"))
        finally:
            self._resource_ready.set()

    def _detect_wait(self) -> float:
        """How long the first export waits for the Azure attributes."""
        return self._imds.timeout + 0.5 if self._imds is not None else 0.0

    def publish(self, snapshot: Snapshot) -> None:
        """Keep the snapshot and queue its events; the export threads do the rest."""
        with self._lock:
            self._latest = snapshot
            if snapshot.events and "logs" in self._settings:
                limit = self._opts["max_queued_records"]
                for event in snapshot.events:
                    if len(self._events) >= limit:
                        seq, _ = self._events.popleft()
                        if seq > self._in_flight:  # one being sent is counted by its send's outcome
                            self._logs.dropped += 1
                    self._event_seq += 1
                    self._events.append((self._event_seq, event))
                self._wake_logs.notify()
            self._wake_metrics.notify()

    def stop(self, timeout: float = 5.0) -> None:
        """Send what is pending once (within ``timeout``) and let the threads go."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._stopping = True
            self._stop_deadline = deadline
            self._wake_metrics.notify_all()
            self._wake_logs.notify_all()
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            log.warning("otel: export still in progress at shutdown (%s); abandoning it", ", ".join(alive))

    # -- export loops

    def _final_timeout(self, configured: float) -> float:
        return max(0.05, min(configured, getattr(self, "_stop_deadline", 0) - time.monotonic()))

    def _metrics_loop(self) -> None:
        settings = self._settings["metrics"]
        transport = make_transport(settings, self.ctx.version)
        encoder = MetricEncoder(self.ctx.version)
        backoff = Backoff(self._opts["backoff_initial"], self._opts["backoff_max"])
        interval = float(self._opts["interval"])
        self._resource_ready.wait(self._detect_wait())
        exported: Snapshot | None = None
        pending: tuple[Snapshot, int] | None = None  # a snapshot that failed and awaits its retry
        next_tick = time.monotonic() + interval

        def is_fresh(snapshot: Snapshot | None) -> bool:
            if snapshot is None:
                return False
            return snapshot is not exported if interval else has_new_results(snapshot, exported)

        try:
            while True:
                with self._lock:
                    while True:
                        now = time.monotonic()
                        due = max(backoff.not_before, next_tick if interval else 0.0)
                        fresh = is_fresh(self._latest)
                        if self._stopping or (fresh and now >= due):
                            break
                        self._wake_metrics.wait(max(0.01, due - now) if fresh else None)
                    stopping, snapshot, resource = self._stopping, self._latest, dict(self._resource)
                if snapshot is None or not is_fresh(snapshot):
                    if stopping:
                        return
                    continue
                if interval:
                    next_tick = max(next_tick + interval, time.monotonic())
                if pending is not None and pending[0] is not snapshot:
                    with self._lock:  # superseded by a newer snapshot: its points are given up
                        self._metrics.dropped += pending[1]
                pending = None
                try:
                    request, points = encoder.encode(snapshot, resource)
                except Exception as exc:  # noqa: BLE001 - a bad value must not kill the export thread
                    self._log_once.warning("encode", "otel: could not encode a snapshot: %s", exc)
                    exported = snapshot
                    continue
                timeout = self._final_timeout(settings.timeout) if stopping else None
                result = send(transport, request, timeout)
                exported = snapshot
                self._account(self._metrics, result, points, backoff, "metrics", settings)
                if not result.ok and result.retryable and not stopping:
                    exported = None  # the retry sends whatever is latest by then
                    pending = (snapshot, points)
                elif not result.ok:
                    with self._lock:
                        self._metrics.dropped += points
                if stopping:
                    return
        finally:
            transport.close()

    def _logs_loop(self) -> None:
        settings = self._settings["logs"]
        transport = make_transport(settings, self.ctx.version)
        backoff = Backoff(self._opts["backoff_initial"], self._opts["backoff_max"])
        throttled = 0  # attempts of the head batch answered RESOURCE_EXHAUSTED without RetryInfo
        self._resource_ready.wait(self._detect_wait())
        try:
            while True:
                with self._lock:
                    while True:
                        now = time.monotonic()
                        if self._stopping or (self._events and now >= backoff.not_before):
                            break
                        self._wake_logs.wait(max(0.01, backoff.not_before - now) if self._events else None)
                    stopping = self._stopping
                    batch = [self._events[i] for i in range(min(512, len(self._events)))]
                    self._in_flight = batch[-1][0] if batch else 0
                    resource = dict(self._resource)
                if not batch:
                    return  # stopping and nothing left
                timeout = self._final_timeout(settings.timeout) if stopping else None
                try:
                    request = encode_logs([event for _, event in batch], resource, self.ctx.version)
                except Exception as exc:  # noqa: BLE001 - an attribute that will not encode
                    self._log_once.warning("encode-logs", "otel: could not encode events: %s", exc)
                    result = SendResult(False, False, f"encode: {exc}")
                else:
                    result = send(transport, request, timeout)
                keep = not result.ok and (result.retryable
                                          or (result.throttled and throttled + 1 < THROTTLED_LOG_ATTEMPTS))
                throttled = throttled + 1 if keep and not result.retryable else 0
                with self._lock:
                    self._in_flight = 0
                    # publish() may have evicted part of the batch meanwhile: what is left of it is the
                    # head of the queue up to the batch's last sequence number, not len(batch) entries
                    last = batch[-1][0]
                    left = 0
                    while left < len(self._events) and self._events[left][0] <= last:
                        left += 1
                    if keep:
                        self._logs.dropped += len(batch) - left  # evicted while in flight: not retried
                    else:
                        for _ in range(left):
                            self._events.popleft()
                        if not result.ok:
                            self._logs.dropped += len(batch)
                    if stopping and not result.ok:  # one attempt at shutdown: give the rest up
                        self._logs.dropped += len(self._events)
                        self._events.clear()
                    done = stopping and not self._events
                    self._account_locked(self._logs, result, len(batch), backoff, "logs", settings)
                if done:
                    return
        finally:
            transport.close()

    def _account(self, counters: DeliveryCounters, result: SendResult, items: int, backoff: Backoff,
                 signal: str, settings: SignalSettings) -> None:
        """Count an export's outcome, schedule a retry, and log state changes once (not every cycle)."""
        with self._lock:
            self._account_locked(counters, result, items, backoff, signal, settings)

    def _account_locked(self, counters: DeliveryCounters, result: SendResult, items: int, backoff: Backoff,
                        signal: str, settings: SignalSettings) -> None:
        """``_account`` for a caller that holds the lock, so that its own bookkeeping and these counters
        change together."""
        if result.ok:
            if counters.consecutive_failures:
                log.info("otel: %s export to %s recovered", signal, settings.endpoint)
            self._log_once.clear(f"failed-{signal}")
            counters.succeeded(items - result.rejected)
            counters.dropped += result.rejected
            backoff.succeeded()
            if result.rejected:
                self._log_once.warning(f"rejected-{signal}", "otel: the collector rejected %d %s items",
                                       result.rejected, signal)
            return
        counters.failed_attempt(1, result.detail)  # gpumon_sink_failed_total counts requests
        delay = backoff.failed(time.monotonic(), result.retry_after)
        self._log_once.warning(f"failed-{signal}", "otel: %s export to %s failed (%s); retrying with backoff, "
                               "next in %.2f s", signal, settings.endpoint, result.detail, delay)

    # -- reporting

    def health(self) -> SinkHealth:
        with self._lock:
            m, lg = self._metrics, self._logs
            # metrics: up only after a first accepted export; logs are sent only when events happen,
            # so they only hold the sink down while their latest attempt failed
            up = self._started and m.up and not lg.consecutive_failures
            detail = m.last_error or lg.last_error
            return SinkHealth(
                up=up,
                exported=m.sent + lg.sent,
                failed=m.failed + lg.failed,
                dropped=m.dropped + lg.dropped,
                detail=detail,
                extra={
                    "queued_records": float(len(self._events)),
                    "consecutive_failures": float(max(m.consecutive_failures, lg.consecutive_failures)),
                    "exported_data_points": float(m.sent),
                    "exported_log_records": float(lg.sent),
                },
            )

    def check(self) -> list[CheckResult]:
        """Send an empty export request per signal: proves address, TLS, headers and protocol."""
        try:
            settings = self._resolve()
        except ValueError as exc:
            return [CheckResult("otel", False, str(exc))]
        if self.missing_dependencies():
            return [CheckResult("otel", False, f"needs: pip install 'gpumon-exporter[{self.extra}]'")]
        pb = _pb()
        results = []
        for signal, s in settings.items():
            item = f"otel {signal}"
            try:
                transport = make_transport(s, self.ctx.version)
            except Exception as exc:  # noqa: BLE001 - bad certificate path, grpc missing
                results.append(CheckResult(item, False, f"{s.endpoint}: {exc}"))
                continue
            empty = (pb.metrics_service.ExportMetricsServiceRequest() if signal == "metrics"
                     else pb.logs_service.ExportLogsServiceRequest())
            started = time.monotonic()
            try:
                result = send(transport, empty, min(s.timeout, 5.0))
            finally:
                transport.close()
            took = (time.monotonic() - started) * 1000
            if result.ok:
                results.append(CheckResult(item, True, f"{s.protocol} {s.endpoint} accepted an empty "
                                                       f"export in {took:.0f} ms"))
            else:
                results.append(CheckResult(item, False, f"{s.protocol} {s.endpoint}: {result.detail}"))
        return results
