"""Real OTLP receivers on loopback (HTTP/protobuf and gRPC) that decode what the otel sink sends with
the opentelemetry-proto classes, their fixtures (``http_receiver``, ``grpc_receiver``: a test module
takes them with ``http_receiver = otlp.http_receiver``), and hostile peers: :class:`TricklingServer`
(answers one byte at a time), :class:`RedirectingReceiver` (redirects exports elsewhere, e.g. to a
:class:`RecordingServer`) and :class:`EchoingOtlpReceiver` (echoes the credentials in its answer)."""

from __future__ import annotations

import gzip
import socket
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

from tests.conftest import serve_http, stop_http


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


TRICKLE = b"HTTP/1.1 200 OK\r\n" + b"X-Slow: a\r\n" * 10_000
"""A reply whose headers never end within any test: a byte at a time it takes hours."""


class TricklingServer:
    """A loopback TCP server that reads the request, then sends ``TRICKLE`` one byte per ``pace``
    seconds until the client goes away; records how long each connection was held."""

    def __init__(self, pace: float = 0.1) -> None:
        self.pace = pace
        self.stop = threading.Event()
        self.cond = threading.Condition()
        self.held: list[float] = []
        """Seconds each finished connection lasted, from accept to the client's disconnect."""
        self.accepted = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.cond:
                self.accepted += 1
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        started = time.monotonic()
        with conn:
            conn.settimeout(5)
            try:
                conn.recv(1 << 20)
                for i in range(len(TRICKLE)):
                    if self.stop.wait(self.pace):  # the pace of the trickle, not a wait for anything
                        return
                    conn.sendall(TRICKLE[i:i + 1])
            except OSError:  # the client shut the connection down: what the test waits for
                pass
        with self.cond:
            self.held.append(time.monotonic() - started)
            self.cond.notify_all()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


class RecordingServer:
    """Answers every request, whatever its method or path, with 200 and an empty body, and records the
    method, path and headers: the host a hostile redirect points at. A 200 to urllib's GET is what
    made a redirected export count as delivered."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with server.lock:
                    server.requests.append((self.command, self.path, dict(self.headers)))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = do_PUT = _any  # noqa: N815 - http.server's naming

        self.httpd, self.origin = serve_http(Handler)

    def close(self) -> None:
        stop_http(self.httpd)


class RedirectingReceiver:
    """A hostile OTLP receiver: every POST to a path in ``routes`` gets that status and Location;
    other paths are proxied to a real OTLP receiver (``real``), so a followed redirect can succeed."""

    def __init__(self, routes: dict[str, tuple[int, str]]) -> None:
        self.routes = routes
        self.real = OtlpHttpReceiver()
        self.hits: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with outer.lock:
                    outer.hits.append((self.path, self.headers.get("Authorization", "")))
                route = outer.routes.get(self.path)
                if route is None:  # the real receiver's answer, through a plain client
                    import urllib.request

                    request = urllib.request.Request(
                        outer.real.endpoint + self.path, data=body, method="POST",
                        headers={"Content-Type": self.headers.get("Content-Type", "")})
                    with urllib.request.urlopen(request, timeout=5) as answer:
                        data = answer.read()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                status, location = route
                self.send_response(status)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd, self.endpoint = serve_http(Handler)

    def close(self) -> None:
        stop_http(self.httpd)
        self.real.close()


class EchoingOtlpReceiver:
    """Answers every export 400 with the Authorization header in the reason phrase, and a control
    character that would start a new log line."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                self.send_response(400, f"bad credentials {self.headers.get('Authorization')}\x1b[31m")
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd, self.endpoint = serve_http(Handler)

    def close(self) -> None:
        stop_http(self.httpd)
