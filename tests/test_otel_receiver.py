"""Real OTLP receivers on loopback (HTTP/protobuf and gRPC) that decode what the otel sink sends with
the opentelemetry-proto classes; the other test_otel_* modules import them. The tests here pin the
sink's ``check()`` probe against them."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.logs.v1 import logs_pb2

from gpumon.sinks.base import SinkContext
from gpumon.sinks.otel import OtelSink


class Received:
    """What a receiver got, shared with the test thread; ``wait`` polls under a condition."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.metrics: list[Any] = []
        self.logs: list[Any] = []
        self.headers: list[dict[str, str]] = []
        self.times: list[float] = []
        """time.monotonic() of each decoded request."""
        self.attempt_times: list[float] = []
        """time.monotonic() of every request, answered or not."""
        self.attempts = 0
        self.answers: list[int] = []
        """Status codes to answer with, in order, before answering ``default`` (200 / OK)."""
        self.delay = 0.0
        self.retry_after: str | None = None
        """Seconds sent with a non-200 answer: HTTP Retry-After; gRPC RetryInfo in the status details."""
        self.release = threading.Event()

    def wait(self, predicate: Callable[[Received], object], timeout: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                value = predicate(self)
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"receiver: condition not met within {timeout} s "
                                         f"({self.attempts} requests, {len(self.metrics)} metrics, "
                                         f"{len(self.logs)} logs)")
                self.cond.wait(left)

    def next_answer(self) -> int:
        with self.cond:
            self.attempts += 1
            self.attempt_times.append(time.monotonic())
            self.cond.notify_all()
            return self.answers.pop(0) if self.answers else 200

    def record(self, kind: str, message: Any, headers: dict[str, str]) -> None:
        with self.cond:
            (self.metrics if kind == "metrics" else self.logs).append(message)
            self.headers.append(headers)
            self.times.append(time.monotonic())
            self.cond.notify_all()

    def metric_points(self) -> dict[str, list[tuple[Any, Any]]]:
        """Every received metric by name: (Metric, ResourceMetrics) of each request, in order."""
        out: dict[str, list[tuple[Any, Any]]] = {}
        with self.cond:
            for request in self.metrics:
                for rm in request.resource_metrics:
                    for sm in rm.scope_metrics:
                        for metric in sm.metrics:
                            out.setdefault(metric.name, []).append((metric, rm))
        return out

    def log_records(self) -> list[tuple[Any, Any]]:
        with self.cond:
            return [(record, rl) for request in self.logs for rl in request.resource_logs
                    for sl in rl.scope_logs for record in sl.log_records]


LOG_RECORD_HAS_EVENT_NAME = "event_name" in logs_pb2.LogRecord.DESCRIPTOR.fields_by_name
"""opentelemetry-proto 1.35 and later; with older classes the receiver cannot see the field at all."""


def event_name(record: Any) -> str:
    """A received record's event name: the EventName field where these classes have it, else the
    ``event.name`` attribute that the sink also sets."""
    if LOG_RECORD_HAS_EVENT_NAME:
        return record.event_name
    return next((kv.value.string_value for kv in record.attributes if kv.key == "event.name"), "")


class OtlpHttpReceiver(Received):
    """``POST /v1/metrics`` and ``/v1/logs`` with protobuf bodies (gzip or not)."""

    def __init__(self) -> None:
        super().__init__()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                status = receiver.next_answer()
                if receiver.delay:
                    receiver.release.wait(receiver.delay)
                if status != 200:
                    self.send_response(status)
                    if receiver.retry_after is not None:
                        self.send_header("Retry-After", receiver.retry_after)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/metrics":
                    message = metrics_service_pb2.ExportMetricsServiceRequest.FromString(body)
                    reply = metrics_service_pb2.ExportMetricsServiceResponse()
                    kind = "metrics"
                elif self.path == "/v1/logs":
                    message = logs_service_pb2.ExportLogsServiceRequest.FromString(body)
                    reply = logs_service_pb2.ExportLogsServiceResponse()
                    kind = "logs"
                else:
                    self.send_error(404)
                    return
                receiver.record(kind, message, {k.lower(): v for k, v in self.headers.items()})
                data = reply.SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def retry_info_status(code: Any, delay: float) -> bytes:
    """A serialized google.rpc.Status carrying RetryInfo, as a throttling gRPC server sends it in the
    ``grpc-status-details-bin`` trailer."""
    from google.protobuf import any_pb2, duration_pb2
    from google.rpc import error_details_pb2, status_pb2

    info = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(
        seconds=int(delay), nanos=round((delay - int(delay)) * 1e9)))
    detail = any_pb2.Any()
    detail.Pack(info)
    return status_pb2.Status(code=code.value[0], message="throttled", details=[detail]).SerializeToString()


class OtlpGrpcReceiver(Received):
    """The OTLP collector services (MetricsService, LogsService) on a real gRPC server. Answers 503
    with UNAVAILABLE, 429 with RESOURCE_EXHAUSTED, others with INVALID_ARGUMENT; with ``retry_after``
    set, the status carries RetryInfo with that delay."""

    def __init__(self) -> None:
        super().__init__()
        import grpc
        from opentelemetry.proto.collector.logs.v1 import logs_service_pb2_grpc
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc

        receiver = self

        def handle(kind: str, request: Any, context: Any, reply: Any) -> Any:
            status = receiver.next_answer()
            if receiver.delay:
                receiver.release.wait(receiver.delay)
            if status != 200:
                code = {503: grpc.StatusCode.UNAVAILABLE, 429: grpc.StatusCode.RESOURCE_EXHAUSTED}.get(
                    status, grpc.StatusCode.INVALID_ARGUMENT)
                if receiver.retry_after is not None:
                    context.set_trailing_metadata((("grpc-status-details-bin",
                                                    retry_info_status(code, float(receiver.retry_after))),))
                context.abort(code, f"test receiver answers {status}")
            receiver.record(kind, request, dict(context.invocation_metadata()))
            return reply

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - generated name
                return handle("metrics", request, context, metrics_service_pb2.ExportMetricsServiceResponse())

        class Logs(logs_service_pb2_grpc.LogsServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - generated name
                return handle("logs", request, context, logs_service_pb2.ExportLogsServiceResponse())

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self.server)
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(Logs(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server.start()

    def close(self) -> None:
        self.release.set()
        self.server.stop(grace=None)


@pytest.fixture
def http_receiver():
    receiver = OtlpHttpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture
def grpc_receiver():
    receiver = OtlpGrpcReceiver()
    yield receiver
    receiver.close()


def make_sink(endpoint: str, tmp_path, environ: dict[str, str] | None = None, **options: Any) -> OtelSink:
    """An OtelSink with fast retries and no IMDS probe unless the test asks for one."""
    from gpumon.config import Section

    values = {"endpoint": endpoint, "azure_detect": False, "backoff_initial": 0.05, "backoff_max": 0.2,
              "timeout": 2.0}
    values.update(options)
    ctx = SinkContext(hostname="node-7", state_dir=str(tmp_path), version="9.9.9")
    return OtelSink(ctx, Section("otel", values), environ=environ or {})


# ------------------------------------------------------------------------------------- check()


def test_check_reports_ok_for_each_signal_over_http(http_receiver, tmp_path):
    results = make_sink(http_receiver.endpoint, tmp_path).check()
    assert [r.item for r in results] == ["otel metrics", "otel logs"]
    assert all(r.ok for r in results), results
    assert f"127.0.0.1:{http_receiver.port}/v1/metrics" in results[0].message
    http_receiver.wait(lambda r: len(r.metrics) == 1 and len(r.logs) == 1)
    assert len(http_receiver.metrics[0].resource_metrics) == 0  # an empty export, no data sent


def test_check_reports_ok_over_grpc(grpc_receiver, tmp_path):
    results = make_sink(grpc_receiver.endpoint, tmp_path, protocol="grpc").check()
    assert all(r.ok for r in results), results
    assert results[0].message.startswith("grpc 127.0.0.1:")


def test_check_names_the_failure_when_nothing_listens(tmp_path):
    from tests.conftest import closed_port

    results = make_sink(f"http://127.0.0.1:{closed_port()}", tmp_path, logs=False).check()
    assert len(results) == 1 and not results[0].ok
    assert "refused" in results[0].message.lower() or "connection" in results[0].message.lower()


def test_check_reports_http_status(http_receiver, tmp_path):
    http_receiver.answers = [401]
    results = make_sink(http_receiver.endpoint, tmp_path, logs=False).check()
    assert not results[0].ok and "HTTP 401" in results[0].message


def test_check_rejects_a_bad_protocol_from_the_environment(tmp_path):
    results = make_sink("", tmp_path, environ={"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}).check()
    assert not results[0].ok and "http/json" in results[0].message
