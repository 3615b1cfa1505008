"""Shared by the remote_write tests: hand-made snapshots, the sink under test, and a
decoder for what it sends (the inverse of gpumon.sinks.remote_write.encoding, written from the
.proto field numbers, not from the encoder)."""

from __future__ import annotations

import ssl
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from gpumon.model import MetricFamily, MetricSpec, MetricType, Snapshot
from gpumon.sinks.base import SinkContext
from gpumon.sinks.remote_write import RemoteWriteSink
from gpumon.sinks.remote_write.encoding import decompress

GPU_TEMP = MetricSpec("gpumon_gpu_temperature_celsius", MetricType.GAUGE, "GPU temperature.", "celsius",
                      ("gpu", "uuid"))
XMIT = MetricSpec("gpumon_ib_port_transmit_bytes_total", MetricType.COUNTER, "Bytes sent.", "bytes",
                  ("device", "port"))
GPU_INFO = MetricSpec("gpumon_gpu_info", MetricType.INFO, "GPU identity.", "", ("gpu", "model", "serial"))


def small_snapshot(t: float, gpus: int = 2, value: float = 40.0) -> Snapshot:
    """A hand-made snapshot: a gauge per GPU, a counter, and an info series with an empty label."""
    families = (
        MetricFamily(GPU_TEMP, tuple(GPU_TEMP.sample(value + g, str(g), f"GPU-{g}") for g in range(gpus))),
        MetricFamily(XMIT, (XMIT.sample(2.5e12, "mlx5_ib0", "1"),)),
        MetricFamily(GPU_INFO, (GPU_INFO.sample(1, "0", "NVIDIA H100 80GB HBM3", ""),)),
    )
    return Snapshot("nd-node", t, families, (), ())


def make_sink(tmp_path: Any, url: str, credential: Any = None, **options: Any) -> RemoteWriteSink:
    """The sink with fast retries (50 ms doubling to 0.5 s) and a 3 s request deadline."""
    cfg = {"url": url, "backoff_initial": 0.05, "backoff_max": 0.5, "timeout": 3.0, **options}
    ctx = SinkContext(hostname="nd-node", state_dir=str(tmp_path / "state"), version="test")
    sink = RemoteWriteSink(ctx, cfg, credential=credential)
    sink.config_backoff_min = 0.2
    return sink


def delivered(sink: RemoteWriteSink) -> bool:
    """Everything spooled has been sent (or given up on) and at least one request went through."""
    health = sink.health()
    return health.extra["requests_queued"] == 0 and health.exported > 0


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _fields(data: bytes) -> list[tuple[int, Any]]:
    out = []
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 2:
            length, pos = _varint(data, pos)
            out.append((number, data[pos:pos + length]))
            pos += length
        elif wire == 1:
            out.append((number, struct.unpack_from("<d", data, pos)[0]))
            pos += 8
        elif wire == 0:
            value, pos = _varint(data, pos)
            out.append((number, value))
        else:
            raise ValueError(f"wire type {wire}")
    return out


def decode_write_request(body: bytes) -> list[tuple[list[tuple[str, str]], list[tuple[float, int]]]]:
    """[(labels in wire order, [(value, timestamp ms)])] per TimeSeries of a WriteRequest."""
    series = []
    for number, ts in _fields(body):
        assert number == 1, f"unexpected WriteRequest field {number}"
        labels, samples = [], []
        for field, value in _fields(ts):
            if field == 1:
                parts = dict(_fields(value))
                labels.append((parts.get(1, b"").decode(), parts.get(2, b"").decode()))
            elif field == 2:
                parts = dict(_fields(value))
                samples.append((parts.get(1, 0.0), parts.get(2, 0)))
        series.append((labels, samples))
    return series


@dataclass
class Received:
    headers: dict[str, str]
    series: list[tuple[list[tuple[str, str]], list[tuple[float, int]]]]


@dataclass
class Reply:
    status: int
    retry_after: str | None = None
    body: str = ""
    hang: bool = False
    location: str | None = None
    echo: bool = False
    """Answer with the request's headers in the body, as some proxies' error pages do."""


class Receiver:
    """A loopback remote-write receiver that decodes what it is sent; answers 204 unless told to
    ``answer`` otherwise (each queued Reply once, in order). HTTPS with ``tls`` (a trustme CA), and
    client certificates required with ``client_ca``."""

    def __init__(self, tls: Any = None, client_ca: Any = None, token: str | None = None,
                 accepts: Callable[[str | None], bool] | None = None, path: str = "/api/v1/write") -> None:
        self.accepts = accepts
        """Judges the Authorization header (or its absence) when given; ``token`` wants it exact."""
        self.paths: list[str] = []
        self.received: list[Received] = []
        self.refused: list[int] = []
        self.times: list[float] = []
        """Monotonic arrival time of every request, answered or not."""
        self.replies: list[Reply] = []
        self.default = Reply(204)
        """The answer once ``replies`` are used up."""
        self.max_body: int | None = None
        """With a value: 413 for every body larger than this many bytes, as a proxy's body limit."""
        self.sizes: list[int] = []
        """The body size of every request, answered or not."""
        self.token = token
        self._lock = threading.Lock()
        self._release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                receiver._handle(self)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        scheme = "http"
        if tls is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls.configure_cert(context)
            if client_ca is not None:
                client_ca.configure_trust(context)
                context.verify_mode = ssl.CERT_REQUIRED
            self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self._httpd.server_address[1]}{path}"
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()

    def answer(self, *replies: Reply) -> None:
        with self._lock:
            self.replies.extend(replies)

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        body = h.rfile.read(int(h.headers.get("Content-Length", 0)))
        headers = {k: v for k, v in h.headers.items()}
        with self._lock:
            self.times.append(time.monotonic())
            self.paths.append(h.path)
            self.sizes.append(len(body))
            reply = self.replies.pop(0) if self.replies else self.default
        if self.max_body is not None and len(body) > self.max_body:
            reply = Reply(413, body="request entity too large")
        if self.token is not None and headers.get("Authorization") != self.token:
            reply = Reply(401, body="bad credentials")
        if self.accepts is not None and not self.accepts(headers.get("Authorization")):
            reply = Reply(401, body="token refused")
        if reply.hang:
            self._release.wait(30)
            return
        if 200 <= reply.status < 300:
            with self._lock:
                self.received.append(Received(headers, decode_write_request(decompress(body))))
        else:
            with self._lock:
                self.refused.append(reply.status)
        payload = reply.body.encode()
        if reply.echo:
            payload += "".join(f"{k}: {v}\n" for k, v in headers.items()).encode() + b"\x00\x1b[2J"
        h.send_response(reply.status)
        if reply.retry_after is not None:
            h.send_header("Retry-After", reply.retry_after)
        if reply.location is not None:
            h.send_header("Location", reply.location)
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        h.wfile.write(payload)

    def samples(self) -> int:
        with self._lock:
            return sum(len(s) for r in self.received for _, s in r.series)

    def close(self) -> None:
        self._release.set()
        self._httpd.shutdown()
        self._httpd.server_close()
