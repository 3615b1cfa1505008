"""The endpoint's HTTP side: the listening socket, and the routes that answer a complete request head
(``/metrics``, ``/health``, ``/healthz``, the landing page, basic auth) into memory for the front
(:mod:`.front`) to write. It knows the sink only as a :class:`Site`: the page to serve, the web
config, the login limiter and the counters.
"""

from __future__ import annotations

import functools
import html
import io
import ipaddress
import json
import logging
import re
import socket
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from io import BufferedIOBase
from typing import Protocol, cast

from gpumon.render import OPENMETRICS_CONTENT_TYPE, TEXT_CONTENT_TYPE
from gpumon.sinks.base import SinkContext
from gpumon.sinks.prometheus.connections import Conn, Reply
from gpumon.sinks.prometheus.page import Page
from gpumon.sinks.prometheus.webconfig import Auth, FailureLimiter, WebConfig

__all__ = ["LANDING", "MAX_HEADERS", "App", "Site", "accepts_gzip", "listen", "source_key"]

log = logging.getLogger("gpumon.sinks.prometheus")


class _SiteSettings(Protocol):
    @property
    def open_healthz(self) -> bool: ...


class Site(Protocol):
    """What the routes read from the sink they serve."""

    ctx: SinkContext
    web: WebConfig
    limiter: FailureLimiter
    page: Page | None

    @property
    def settings(self) -> _SiteSettings: ...

    def count(self, what: str) -> None: ...


LANDING = """<!doctype html>
<html><head><title>gpumon</title></head>
<body><h1>gpumon {version}</h1>
<p>GPU and InfiniBand telemetry for {host}.</p>
<ul><li><a href="/metrics">/metrics</a></li><li><a href="/health">/health</a> (verdict)</li><li><a href="/healthz">/healthz</a> (liveness)</li></ul>
</body></html>
"""


def accepts_gzip(header: str) -> bool:
    """``Accept-Encoding`` allows gzip (``gzip;q=0`` refuses it)."""
    for part in header.split(","):
        coding, _, params = part.strip().partition(";")
        if coding.strip().lower() in ("gzip", "*"):
            q = params.strip()
            if q.startswith("q="):
                try:
                    return float(q[2:]) > 0
                except ValueError:
                    return False
            return True
    return False


def listen(host: str, port: int, backlog: int) -> socket.socket:
    """The listening socket; ``[::]`` also takes IPv4 (as node_exporter does)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


@functools.lru_cache(maxsize=4096)
def source_key(address: str) -> str:
    """The address a per-source limit counts: IPv4 as is (also when mapped into IPv6), IPv6 by its
    /64, since one host is routinely given a whole /64. Remembered for the last 4,096 addresses:
    parsing one costs more than the rest of an accept, and a flood comes from few."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class _Blocking(Exception):
    """The request needs work that takes a while (bcrypt, the first gzip or OpenMetrics body of a
    snapshot): it is answered on a worker thread."""


class _Out:
    """The handler's ``wfile``: chunks kept as they are (the page is never copied) for the loop."""

    __slots__ = ("chunks",)

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.chunks.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass


class _Headers:
    """A request's header fields by lower-case name: what the routes read, parsed in a few
    microseconds where ``http.client``'s e-mail parser takes a hundred and more (a flood of 429s
    and every scrape pay for it)."""

    __slots__ = ("_fields", "count")

    def __init__(self) -> None:
        self._fields: dict[str, list[str]] = {}
        self.count = 0

    def add(self, name: str, value: str) -> None:
        self._fields.setdefault(name.lower(), []).append(value)
        self.count += 1

    def get(self, name: str, default: str | None = None) -> str | None:
        values = self._fields.get(name.lower())
        return values[0] if values else default

    def get_all(self, name: str) -> list[str] | None:
        return self._fields.get(name.lower())


_VERSION = re.compile(r"HTTP/(\d)\.(\d)")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_PHRASES = {status.value: status.phrase for status in HTTPStatus}
MAX_HEADERS = 100
"""Header lines in one request, as the stdlib's parser allows."""


class App:
    """What the front hands complete request heads to."""

    def __init__(self, sink: Site) -> None:
        self.sink = sink

    def respond(self, conn: Conn, head: bytes) -> Reply | Callable[[], Reply]:
        handler = _Handler(self.sink, conn, head)
        try:
            return handler.run()
        except _Blocking:
            return handler.run_blocking

    def refuse(self, conn: Conn, status: int) -> Reply:
        handler = _Handler(self.sink, conn, b"")
        handler.requestline, handler.command, handler.request_version = "", "", "HTTP/1.1"
        if status == HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE:
            handler.send_error(status, "Request header too large")
        else:
            handler.send_error(status)
        return Reply(handler.wfile.chunks, True)


class _Handler(BaseHTTPRequestHandler):
    """One request whose whole head has arrived, answered into memory; the front writes it.

    The stdlib's parsing and error pages are kept; its socket handling is not used."""

    protocol_version = "HTTP/1.1"
    server_version = "gpumon"
    sys_version = ""

    def __init__(self, sink: Site, conn: Conn, head: bytes) -> None:  # noqa: D107
        # not BaseRequestHandler.__init__: that would read the socket and answer at once
        self.sink = sink
        self.conn = conn
        self.client_address = conn.address
        self.rfile = cast(BufferedIOBase, io.BytesIO(head))
        self.wfile: _Out = _Out()  # type: ignore[assignment]
        self.close_connection = True
        self.request_version = "HTTP/1.1"
        self.in_worker = False
        self._method: Callable[[], None] | None = None
        self._auth: Auth | None = None

    def parse_request(self) -> bool:
        """The stdlib's checks (request line, version, 0.9, ``Connection``, 100 header lines), with
        the head already whole in memory and bounded by the front."""
        self.command = ""
        self.request_version = version = self.default_request_version
        self.close_connection = True
        requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        self.requestline = requestline
        words = requestline.split()
        if len(words) == 3:
            version = words[-1]
            match = _VERSION.fullmatch(version)
            if match is None:
                self.send_error(HTTPStatus.BAD_REQUEST, f"Bad request version ({version!r})")
                return False
            number = (int(match[1]), int(match[2]))
            if number >= (2, 0):
                self.send_error(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, f"Invalid HTTP version ({version})")
                return False
            if number >= (1, 1):
                self.close_connection = False
            self.request_version = version
        elif len(words) == 2 and words[0] == "GET":
            self.command, self.path = words
            self.headers = _Headers()  # type: ignore[assignment]
            return True  # HTTP/0.9: no headers, closed after the body
        elif not words:
            return False
        else:
            self.send_error(HTTPStatus.BAD_REQUEST, f"Bad request syntax ({requestline!r})")
            return False
        self.command, self.path = words[0], words[1]
        if self.path.startswith("//"):
            self.path = "/" + self.path.lstrip("/")
        headers = _Headers()
        name = ""
        for raw in self.rfile.read().split(b"\n"):
            line = str(raw, "iso-8859-1").rstrip("\r")
            if not line:
                break
            if line[0] in " \t" and name:  # obsolete line folding: part of the previous value
                values = headers.get_all(name) or [""]
                values[-1] += " " + line.strip()
                continue
            name, colon, value = line.partition(":")
            if not colon or not _TOKEN.fullmatch(name):
                self.send_error(HTTPStatus.BAD_REQUEST, "Bad header line")
                return False
            if headers.count >= MAX_HEADERS:
                self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Too many headers")
                return False
            headers.add(name, value.strip(" \t"))
        self.headers = headers  # type: ignore[assignment]
        connection = (headers.get("Connection") or "").lower()
        if "close" in connection:
            self.close_connection = True
        elif "keep-alive" in connection and self.request_version >= "HTTP/1.0":
            self.close_connection = False
        return True

    def run(self) -> Reply:
        self.raw_requestline = self.rfile.readline()
        if self.parse_request():
            self._method = getattr(self, "do_" + self.command, None)
            if self._method is None:
                self.send_error(HTTPStatus.NOT_IMPLEMENTED, f"Unsupported method ({self.command!r})")
            elif self._carries_body():  # read as the next request, it would be smuggled past a proxy
                self.send_error(HTTPStatus.BAD_REQUEST, f"A {self.command} request must not carry a body")
            else:
                self._method()
        return Reply(self.wfile.chunks, self.close_connection)

    def run_blocking(self) -> Reply:
        """The same request on a worker thread, where a bcrypt check, compressing a new page or
        rendering it as OpenMetrics may take milliseconds without holding up the loop."""
        self.in_worker = True
        assert self._method is not None
        self._method()
        return Reply(self.wfile.chunks, self.close_connection)

    def _carries_body(self) -> bool:
        lengths = self.headers.get_all("Content-Length") or []
        return self.headers.get("Transfer-Encoding") is not None or any(v.strip() != "0" for v in lengths)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Every error has a status line (the stdlib sends a bare body when it could not read the
        version and fell back to HTTP/0.9) and closes the connection."""
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.0"
        super().send_error(code, message, explain)
        self.close_connection = True

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s", self.address_string(), format % args)

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    def _denied(self, head: bool, path: str) -> bool:
        """Answer 401 or 429 when basic auth is required and not met; True when answered. A check
        that needs bcrypt raises ``_Blocking`` in the loop; a 429 never costs one."""
        sink = self.sink
        web = sink.web
        if not web.auth_required or (path == "/healthz" and sink.settings.open_healthz):
            return False
        header = self.headers.get("Authorization")
        if self._auth is None:  # screened once, in the loop: that took the check from the budget
            self._auth = web.screen(header, self.conn.source, sink.limiter)
        if self._auth is Auth.PENDING:
            if not self.in_worker:
                raise _Blocking
            self._auth = web.check(header, self.conn.source, sink.limiter)
        verdict = self._auth
        if verdict is Auth.THROTTLED:
            sink.count("throttled")
            self._send(429, b"Too many failed logins\n", "text/plain; charset=utf-8", head,
                       {"Retry-After": str(sink.limiter.retry_after)})
        elif verdict is Auth.DENIED:
            self._send(401, b"Unauthorized\n", "text/plain; charset=utf-8", head,
                       {"WWW-Authenticate": 'Basic realm="gpumon"'})
        return verdict is not Auth.OK

    def _route(self, head: bool) -> None:
        sink = self.sink
        path = self.path.split("?", 1)[0]
        if self._denied(head, path):
            return
        if path == "/metrics":
            page = sink.page
            if page is None:
                self._send(503, b"no collection yet\n", "text/plain; charset=utf-8", head)
                return
            openmetrics = "application/openmetrics-text" in (self.headers.get("Accept") or "")
            gzipped = accepts_gzip(self.headers.get("Accept-Encoding") or "")
            if not self.in_worker and not page.ready(openmetrics, gzipped):
                raise _Blocking  # the first such scrape of a snapshot compresses or renders: not in the loop
            body = page.body(openmetrics, gzipped)
            extra = {"Vary": "Accept, Accept-Encoding"}
            if gzipped:
                extra["Content-Encoding"] = "gzip"
            self._send(200, body, OPENMETRICS_CONTENT_TYPE if openmetrics else TEXT_CONTENT_TYPE, head, extra)
            sink.count("scrapes")
        elif path == "/health":
            self._health(head)
        elif path == "/healthz":
            if sink.ctx.loop_alive():
                self._send(200, b"ok\n", "text/plain; charset=utf-8", head)
            else:
                self._send(503, b"collector loop is not running\n", "text/plain; charset=utf-8", head)
        elif path == "/":
            landing = LANDING.format(version=html.escape(sink.ctx.version), host=html.escape(sink.ctx.hostname))
            self._send(200, landing.encode("utf-8"), "text/html; charset=utf-8", head)
        else:
            self._send(404, b"not found\n", "text/plain; charset=utf-8", head)

    def _health(self, head: bool) -> None:
        """The node's health verdict as JSON: a verdict for people and tools, not a liveness probe
        (``/healthz`` is that): it answers 200 whatever the verdict, so a probe wired to it by
        mistake does not restart gpumon on a sick node."""
        verdict_of = self.sink.ctx.health_verdict
        if verdict_of is None:
            self._send(404, b"health verdicts are off ([health] enabled = false)\n", "text/plain; charset=utf-8",
                       head)
            return
        verdict = verdict_of()
        if verdict is None:
            self._send(503, b"no verdict yet\n", "text/plain; charset=utf-8", head)
            return
        self._send(200, json.dumps(verdict).encode("utf-8") + b"\n", "application/json", head)

    def _send(self, code: int, body: bytes, content_type: str, head: bool,
              extra: dict[str, str] | None = None) -> None:
        """Status line and headers as one chunk, the body (the page itself, not a copy) as the next."""
        if self.request_version == "HTTP/0.9":  # no status line, no headers
            if not head:
                self.wfile.chunks.append(body)
            return
        if log.isEnabledFor(logging.DEBUG):
            self.log_request(code, len(body))
        lines = [f"HTTP/1.1 {code} {_PHRASES.get(code, '')}\r\nServer: gpumon\r\nDate: {self.date_time_string()}"
                 f"\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"]
        if self.request_version == "HTTP/1.0" and not self.close_connection:
            lines.append("Connection: keep-alive\r\n")  # else a 1.0 keep-alive client waits for EOF
        for name, value in {**self.sink.web.headers, **(extra or {})}.items():
            lines.append(f"{name}: {value}\r\n")
        lines.append("\r\n")
        self.wfile.chunks.append("".join(lines).encode("latin-1", "strict"))
        if not head:
            self.wfile.chunks.append(body)

    _date_cache: tuple[int, str] = (0, "")

    def date_time_string(self, timestamp: float | None = None) -> str:
        """The Date header, formatted once per second rather than per response."""
        if timestamp is not None:
            return super().date_time_string(timestamp)
        now = int(time.time())
        second, text = _Handler._date_cache
        if second != now:
            text = super().date_time_string(now)
            _Handler._date_cache = (now, text)
        return text
