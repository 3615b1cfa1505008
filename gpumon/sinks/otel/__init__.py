"""The OpenTelemetry sink: snapshots as OTLP metrics, events as OTLP log records.

The values in a snapshot are already collected and already cumulative where they count, so the sink
does not run them through the SDK's instruments and aggregation (a second sampling clock that would
re-timestamp them). It encodes the snapshot straight into the OTLP protobuf messages, with the
snapshot's own timestamp, and sends them over OTLP/HTTP (protobuf) or OTLP/gRPC from two uploaders
of the shared delivery machine (:mod:`gpumon.sinks.delivery`): one for metrics, one for logs, so a
slow metrics export never delays an XID's log record. ``publish`` only puts the snapshot in a
latest-item slot and appends its events to a bounded queue (:mod:`gpumon.sinks.queues`).

Nothing here imports protobuf, grpc or OpenTelemetry at module import: the registry imports this
module to read the class attributes, and a daemon without the ``otel`` sink must not pay for them.

- :mod:`~gpumon.sinks.otel.settings`: ``[otel]`` and the OTEL_EXPORTER_OTLP_* variables, per signal;
- :mod:`~gpumon.sinks.otel.resource`: the resource attributes (host, Azure, Kubernetes);
- :mod:`~gpumon.sinks.otel.encoding`: snapshots and events as OTLP messages (names from
  :mod:`gpumon.sinks.otel.mapping`);
- :mod:`~gpumon.sinks.otel.transport`: OTLP/HTTP and OTLP/gRPC, and what an answer means;
- :mod:`~gpumon.sinks.otel.export`: per signal, encode a batch, send it, classify the answer;
- :mod:`~gpumon.sinks.otel.sink`: the OtelSink: its queues, its two uploaders, health and check.
"""

from __future__ import annotations

from gpumon.sinks.otel.encoding import (
    SEVERITY_NUMBER,
    MetricEncoder,
    encode_logs,
    event_attributes,
    event_name,
    log_record_has_event_name,
)
from gpumon.sinks.otel.resource import (
    PHYSICAL_HOST,
    azure_attributes,
    kubernetes_attributes,
    resource_attributes,
)
from gpumon.sinks.otel.settings import (
    DEFAULT_GRPC_ENDPOINT,
    DEFAULT_HTTP_ENDPOINT,
    DEFAULT_TIMEOUT,
    GRPC,
    HTTP_PROTOBUF,
    IMDS_ALIASES,
    OPTIONS,
    SIGNALS,
    OtelSettings,
    SignalSettings,
    resolve_settings,
)
from gpumon.sinks.otel.sink import OtelSink
from gpumon.sinks.otel.transport import (
    RETRYABLE_HTTP,
    THROTTLED_LOG_ATTEMPTS,
    GrpcTransport,
    HttpTransport,
    SendResult,
    make_transport,
    send,
)

__all__ = [
    "DEFAULT_GRPC_ENDPOINT", "DEFAULT_HTTP_ENDPOINT", "DEFAULT_TIMEOUT", "GRPC", "HTTP_PROTOBUF", "IMDS_ALIASES",
    "OPTIONS", "PHYSICAL_HOST", "RETRYABLE_HTTP", "SEVERITY_NUMBER", "SIGNALS", "THROTTLED_LOG_ATTEMPTS",
    "GrpcTransport", "HttpTransport", "MetricEncoder", "OtelSettings", "OtelSink", "SendResult", "SignalSettings",
    "azure_attributes", "encode_logs", "event_attributes", "event_name", "kubernetes_attributes",
    "log_record_has_event_name", "make_transport", "resolve_settings", "resource_attributes", "send",
]
