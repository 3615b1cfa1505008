"""Sending one OTLP message: over HTTP (protobuf, with a whole-request deadline) or gRPC, and what
the collector's answer means (retry, Retry-After / RetryInfo, partial success, throttling)."""

from __future__ import annotations

import gzip
import http.client
import logging
import socket
import ssl
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpumon.sinks.common import (
    MAX_REDIRECTS,
    parse_retry_after,
    read_regular_file,
    receiver_text,
    redirect_target,
    retry_after_from_headers,
    secrets_of,
)
from gpumon.sinks.otel.encoding import pb_modules
from gpumon.sinks.otel.settings import GRPC, SignalSettings

if TYPE_CHECKING:
    pass


log = logging.getLogger("gpumon.sinks.otel")


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
    config: bool = False
    """A configuration fault (a redirect that is not followed): retried slowly, as a person has to act."""


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


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """urllib's own handler re-sends a 301/302/303 as a GET without the body but with every header,
    Authorization included, to any host the ``Location`` names, and the new request carries no
    deadline: here every redirect surfaces as an HTTPError, and :meth:`HttpTransport.send` decides."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> None:
        return None


class HttpTransport:
    """OTLP/HTTP with binary protobuf bodies (stdlib only, one request per export, each bounded as a
    whole by the export timeout, redirects included)."""

    def __init__(self, settings: SignalSettings, version: str) -> None:
        self.settings = settings
        self._headers = {
            "Content-Type": "application/x-protobuf",
            "User-Agent": f"gpumon/{version}",
            **dict(settings.headers),
        }
        if settings.compression == "gzip":
            self._headers["Content-Encoding"] = "gzip"
        self._secrets = secrets_of(settings.headers)  # the configured ones: the protocol's are no secret
        handlers: list[Any] = [_DeadlineHTTPHandler(), _NoRedirect()]
        if settings.tls:
            context = ssl.create_default_context(cafile=settings.certificate or None)
            if settings.client_certificate:
                context.load_cert_chain(settings.client_certificate, settings.client_key or None)
            handlers.append(_DeadlineHTTPSHandler(context))
        self._opener = urllib.request.build_opener(*handlers)

    def send(self, body: bytes, timeout: float | None = None) -> SendResult:
        if self.settings.compression == "gzip":
            body = gzip.compress(body, 6)
        seconds = timeout or self.settings.timeout
        deadline = _Deadline(seconds)  # one deadline for the request and every redirect it meets
        url = self.settings.endpoint
        try:
            for hop in range(MAX_REDIRECTS + 1):
                result, url = self._exchange(url, body, seconds, deadline, last=hop == MAX_REDIRECTS)
                if result is not None:
                    return result
            raise AssertionError("unreachable: the last hop always answers")  # pragma: no cover
        finally:
            deadline.finish()

    def _exchange(self, url: str, body: bytes, seconds: float, deadline: _Deadline, last: bool
                  ) -> tuple[SendResult | None, str]:
        """One request: its result, or (None, the URL of a same-origin 307/308 to send it to next)."""
        request = urllib.request.Request(url, data=body, headers=self._headers, method="POST")
        request.deadline = deadline  # type: ignore[attr-defined]
        try:
            with self._opener.open(request, timeout=seconds) as response:
                reply = response.read(1 << 20)
            if deadline.expired:  # shut down mid-body: a truncated reply is no answer
                raise TimeoutError
            return SendResult(True, rejected=_rejected(self.settings.signal, reply)), url
        except urllib.error.HTTPError as exc:
            with exc:  # release the connection; the body is not read
                if 300 <= exc.code < 400:
                    target, why = redirect_target(url, exc.code, exc.headers.get("Location"))
                    if target is not None and not last:
                        return None, target
                    why = why or f"more than {MAX_REDIRECTS} redirects"
                    return SendResult(False, True, f"{why}: check the endpoint", config=True), url
                retry_after = retry_after_from_headers(exc.headers)
                phrase = receiver_text(str(exc.reason), self._secrets, 80)
                return SendResult(False, exc.code in RETRYABLE_HTTP, f"HTTP {exc.code} {phrase}".rstrip(),
                                  retry_after), url
        except (OSError, ValueError, http.client.HTTPException) as exc:  # refused, reset, timeout, TLS, bad URL
            if deadline.expired:
                return SendResult(False, True, f"timed out: no complete answer within the {seconds:g} s "
                                               "deadline"), url
            reason: object = getattr(exc, "reason", None) or exc
            if isinstance(reason, ValueError) and not isinstance(reason, OSError) and "header" in str(reason).lower():
                # http.client's message quotes the header: it may be a credential
                return SendResult(False, True, "a request header is not valid HTTP (not shown)", config=True), url
            return SendResult(False, True, f"{type(reason).__name__}: "
                                           f"{receiver_text(str(reason), self._secrets)}"), url

    def close(self) -> None:
        pass


def _rejected(signal: str, reply: bytes) -> int:
    """Items refused in an OTLP partial success (an empty body is a full success)."""
    if not reply:
        return 0
    pb = pb_modules()
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
                return read_regular_file(path) if path else None

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
        self._secrets = secrets_of(settings.headers)

    def send_message(self, message: Any, timeout: float | None = None) -> SendResult:
        try:
            response = self._call(message, timeout=timeout or self.settings.timeout, metadata=self._metadata)
        except self._grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            name = getattr(code, "name", str(code))
            details = receiver_text(str(exc.details() or ""), self._secrets) if hasattr(exc, "details") else ""
            trailing = (exc.trailing_metadata() or ()) if hasattr(exc, "trailing_metadata") else ()
            retry_after = grpc_retry_delay(trailing)
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


def grpc_retry_delay(trailing: Any) -> float | None:
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
