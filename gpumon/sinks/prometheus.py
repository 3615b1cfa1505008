"""The embedded Prometheus endpoint: a page rendered once per snapshot, served by a threaded server.

A scrape never triggers a collection: ``publish`` renders the snapshot to text 0.0.4 (and its gzip
twin) and swaps it in; OpenMetrics is rendered on the first scrape that asks for it and kept with
the page. Each connection gets its own thread, its own socket timeout and, with TLS, its own
handshake, so an idle or garbage-sending client cannot hold up other scrapes.
"""

from __future__ import annotations

import gzip
import html
import ipaddress
import json
import logging
import queue
import re
import select
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import BufferedIOBase
from typing import cast

from gpumon.config import (
    ConfigError,
    Option,
    SectionSchema,
    format_listen,
    listen_check,
    parse_listen,
    readable_file_check,
)
from gpumon.log_once import LogOnce
from gpumon.model import MetricFamily, Snapshot
from gpumon.render import OPENMETRICS_CONTENT_TYPE, TEXT_CONTENT_TYPE, Renderer
from gpumon.sinks.base import CheckResult, Sink, SinkHealth
from gpumon.sinks.dcgm_compat import DcgmCompat
from gpumon.sinks.webconfig import Auth, FailureLimiter, WebConfig, file_stamp, load_web_config

log = logging.getLogger("gpumon.sinks.prometheus")


@dataclass(frozen=True)
class PrometheusSettings:
    listen: str
    web_config_file: str
    request_timeout: float
    first_byte_timeout: float
    backlog: int
    max_connections: int
    max_connections_per_source: int
    max_header_bytes: int
    auth_failures_per_minute: float
    compat: str
    web_config_check_interval: float


OPTIONS = SectionSchema(
    "prometheus",
    "The embedded Prometheus endpoint (the default sink).",
    (
        Option("listen", str, "0.0.0.0:9470", "Address and port to serve /metrics on; `[::]:9470` for IPv6.",
               check=listen_check),
        Option("web_config_file", str, "",
               "Exporter-toolkit web config (YAML) with `tls_server_config` and `basic_auth_users`, the "
               "same file node_exporter takes as `--web.config.file`. Empty: plain HTTP, no auth.",
               check=readable_file_check),
        Option("request_timeout", float, 10.0,
               "Seconds a kept-alive connection may stay idle, and a request may take to arrive and be "
               "answered, before the connection is closed.", min=0.1, max=300.0),
        Option("first_byte_timeout", float, 2.0,
               "Seconds a new connection may take to finish its TLS handshake and send the first byte of "
               "its request; an idle or stalled one is closed then, freeing its slot.", min=0.1, max=60.0),
        Option("backlog", int, 256, "Listen backlog: pending connections the kernel queues.",
               min=16, max=65535),
        Option("max_connections", int, 128,
               "Connections served at once. When all are taken, a newcomer displaces the oldest connection "
               "that is not answering a request, or is closed at once when there is none, so slow or "
               "flooding clients cannot exhaust threads and file descriptors.", min=1, max=10000),
        Option("max_connections_per_source", int, 32,
               "Connections one source address (an IPv6 /64) may hold while all `max_connections` are "
               "taken: beyond it a newcomer from that source is closed at once, and cannot displace others.",
               min=1, max=10000),
        Option("max_header_bytes", int, 16384,
               "Largest request head (request line and all headers) read; a larger one gets `431` and "
               "the connection is closed.", min=1024, max=262144),
        Option("auth_failures_per_minute", float, 30.0,
               "Failed basic-auth checks (a bcrypt check each) one source address may cost per minute, "
               "with a burst of ten seconds' worth; beyond it the source gets `429` without a check. "
               "Credentials that were verified once are remembered and never limited.",
               min=1.0, max=60000.0),
        Option("compat", str, "", "`dcgm-exporter`: also serve dcgm-exporter's default counters under its "
               "names, units and labels (docs/dcgm-exporter.md), so its dashboards and alerts work unchanged.",
               choices=("", "dcgm-exporter")),
        Option("web_config_check_interval", float, 10.0,
               "Seconds between checks of the web-config file and the certificate, key and CA files it "
               "names; a changed file is loaded and used for new connections without a restart.",
               min=0.5, max=3600.0),
    ),
    PrometheusSettings,
)

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


class Page:
    """One snapshot's exposition in every variant a scraper may ask for, built at most once each.

    ``extra`` is text appended after gpumon's families (dcgm-exporter's names in compat mode), in
    text 0.0.4; OpenMetrics gets it with counters typed ``unknown`` (their names lack ``_total``)."""

    def __init__(self, families: tuple[MetricFamily, ...], text: bytes, extra: str = "") -> None:
        self._families = families
        self._extra = extra
        self._bodies: dict[tuple[bool, bool], bytes] = {(False, False): text + extra.encode("utf-8")}
        self._lock = threading.RLock()  # the gzip variant builds the plain one under the same lock

    def body(self, openmetrics: bool, gzipped: bool) -> bytes:
        key = (openmetrics, gzipped)
        found = self._bodies.get(key)
        if found is not None:
            return found
        with self._lock:
            found = self._bodies.get(key)
            if found is None:
                if gzipped:
                    found = gzip.compress(self.body(openmetrics, False), 6, mtime=0)
                else:  # OpenMetrics plain: rendered without the shared prefix cache (rarely asked)
                    text = Renderer().render(self._families, openmetrics=True)
                    if self._extra:
                        extra = re.sub(r"^(# TYPE \S+) counter$", r"\1 unknown", self._extra, flags=re.M)
                        text = text[: -len("# EOF\n")] + extra + "# EOF\n"
                    found = text.encode("utf-8")
                self._bodies[key] = found
            return found


def source_key(address: str) -> str:
    """The address a per-source limit counts: IPv4 as is (also when mapped into IPv6), IPv6 by its
    /64, since one host is routinely given a whole /64."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


@dataclass(eq=False)
class _Conn:
    """One accepted connection's slot: who holds it, until when, and whether it may be taken."""

    sock: socket.socket
    source: str
    deadline: float
    """Monotonic time the reaper cuts the connection: first byte, then each request in turn."""
    since: float = field(default_factory=time.monotonic)
    busy: bool = False
    """A parsed request is being answered: no newcomer may take this slot."""
    gone: bool = False
    """Evicted or reaped: the slot no longer counts."""

    def cut(self) -> None:
        """Wake the connection's thread from a blocked handshake, read or write."""
        try:
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)  # the kernel's, also under TLS
        except OSError:
            pass


class _Slots:
    """The ``max_connections`` slots and who holds them.

    When all are taken, a newcomer takes the slot of a connection that is not answering a parsed
    request (one silent on the wire before one with bytes waiting; from the source holding the most;
    oldest first), unless the newcomer's own source already holds ``per_source``. So idle, stalled or
    reconnecting clients can never lock scrapers out, and answers already under way are never cut.
    """

    def __init__(self, limit: int, per_source: int) -> None:
        self.limit, self.per_source = limit, per_source
        self.conns: set[_Conn] = set()
        self.by_source: dict[str, int] = {}
        self.lock = threading.Lock()

    def admit(self, sock: socket.socket, source: str, deadline: float) -> tuple[_Conn | None, _Conn | None]:
        """(the new connection or None when refused, the connection it displaced or None)."""
        with self.lock:
            victim = None
            if len(self.conns) >= self.limit:
                if self.by_source.get(source, 0) >= self.per_source:
                    return None, None
                victim = self._victim()
                if victim is None:
                    return None, None
                self._drop(victim)
            conn = _Conn(sock, source, deadline)
            self.conns.add(conn)
            self.by_source[source] = self.by_source.get(source, 0) + 1
        if victim is not None:
            victim.cut()
        return conn, victim

    def release(self, conn: _Conn) -> None:
        with self.lock:
            if not conn.gone:
                self._drop(conn)

    def reap(self, now: float) -> int:
        """Cut every connection past its deadline; return how many."""
        with self.lock:
            late = [conn for conn in self.conns if conn.deadline < now]
            for conn in late:
                self._drop(conn)
        for conn in late:
            conn.cut()
        return len(late)

    def __len__(self) -> int:
        return len(self.conns)

    def _drop(self, conn: _Conn) -> None:
        conn.gone = True
        self.conns.discard(conn)
        left = self.by_source[conn.source] - 1
        if left:
            self.by_source[conn.source] = left
        else:
            del self.by_source[conn.source]

    def _victim(self) -> _Conn | None:
        idle = [conn for conn in self.conns if not conn.busy]
        if not idle:
            return None
        silent = _silent(idle) or idle
        return max(silent, key=lambda conn: (self.by_source[conn.source], -conn.since))


def _silent(conns: list[_Conn]) -> list[_Conn]:
    """The connections with nothing waiting to be read: a scraper's request that has arrived but is
    not parsed yet shows as readable, an idle or stalled client does not."""
    poller = select.poll()
    by_fd: dict[int, _Conn] = {}
    for conn in conns:
        fd = conn.sock.fileno()
        if fd >= 0:
            poller.register(fd, select.POLLIN)
            by_fd[fd] = conn
    ready = {fd for fd, _ in poller.poll(0)}
    return [conn for fd, conn in by_fd.items() if fd not in ready]


def _readable(sock: socket.socket, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the first byte (or the close) of a request."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    poller = select.poll()
    try:
        poller.register(sock, select.POLLIN)
    except (OSError, ValueError):  # closed under us (evicted, reaped)
        return False
    return bool(poller.poll(max(0, int(timeout * 1000))))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, address, handler: type[_Handler], sink: PrometheusSink, backlog: int, ipv6: bool) -> None:
        self.handler = handler
        """Made per connection by ``_handle``, with the connection's ``_Conn``."""
        self.address_family = socket.AF_INET6 if ipv6 else socket.AF_INET
        self.request_queue_size = backlog
        self.sink = sink
        self.slots = _Slots(sink.settings.max_connections, sink.settings.max_connections_per_source)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.idle = 0
        self.idle_lock = threading.Lock()
        self.closed = threading.Event()
        self.admitted = threading.Event()
        """Set on each admitted connection: the reaper sleeps on it while no connection is open."""
        super().__init__(address, handler)
        self.reaper = threading.Thread(target=self._reap, name="prometheus-reaper", daemon=True)
        self.reaper.start()

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()

    IDLE_SECONDS = 30.0
    """How long a finished connection's thread waits for the next connection before it exits."""

    def process_request(self, request, client_address) -> None:
        """On the accept thread. A connection takes a slot (see ``_Slots``) or is closed, never queued.
        It goes to an idle connection thread, or to a new one when none is idle: starting a thread per
        scrape was most of the accept loop's time under load (docs/performance.md), and every
        connection still has a thread of its own, so an idle client holds only that."""
        deadline = time.monotonic() + self.sink.settings.first_byte_timeout
        conn, displaced = self.slots.admit(request, source_key(client_address[0]), deadline)
        if displaced is not None:
            self.sink.count("evictions")
        if conn is None:
            self.sink.count("failures")
            self.shutdown_request(request)
            return
        self.admitted.set()
        with self.idle_lock:
            reuse = self.idle > 0
            if reuse:
                self.idle -= 1  # reserved: that thread will take this job off the queue
        if reuse:
            self.jobs.put((conn, client_address))
            return
        try:
            threading.Thread(target=self._serve, args=(conn, client_address), name="prometheus-conn",
                             daemon=True).start()
        except BaseException:
            self.slots.release(conn)
            self.shutdown_request(request)
            raise

    def _serve(self, conn: _Conn, client_address) -> None:
        while True:
            try:
                self._handle(conn, client_address)
            except Exception:
                self.handle_error(conn.sock, client_address)
            finally:
                self.slots.release(conn)
                self.shutdown_request(conn.sock)
            if self.closed.is_set():
                return
            with self.idle_lock:
                self.idle += 1
            try:
                job = self.jobs.get(timeout=self.IDLE_SECONDS)
            except queue.Empty:
                with self.idle_lock:
                    if self.idle > 0:  # nobody reserved a thread meanwhile: this one may go
                        self.idle -= 1
                        return
                job = self.jobs.get()  # reserved: the job is on its way
            if job is None:  # the server closed
                return
            conn, client_address = job

    def server_close(self) -> None:
        self.closed.set()
        self.admitted.set()
        super().server_close()
        with self.idle_lock:
            idle, self.idle = self.idle, 0
        for _ in range(idle):  # wake the idle threads so they exit
            self.jobs.put(None)

    def _reap(self) -> None:
        """Cut connections that trickle a handshake or request slower than a per-read timeout sees,
        and readers too slow to take their answer. With no connection open it sleeps until one is
        admitted, so an idle endpoint does not wake four times a second."""
        while not self.closed.is_set():
            if not len(self.slots):
                self.admitted.wait()
            self.admitted.clear()
            if self.closed.wait(0.25):
                return
            for _ in range(self.slots.reap(time.monotonic())):
                self.sink.count("failures")

    def _handle(self, conn: _Conn, client_address) -> None:
        """Runs on the connection's own thread: the TLS handshake happens here, never in accept.
        The handshake and the request's first byte must come within ``first_byte_timeout``."""
        sink = self.sink
        conn.sock.settimeout(sink.settings.first_byte_timeout)
        context = sink.web.ssl_context
        if context is not None and not self._handshake(conn, context, client_address):
            return
        if not _readable(conn.sock, conn.deadline - time.monotonic()):
            return  # idle: the slot goes back without waiting for request_timeout
        conn.deadline = time.monotonic() + sink.settings.request_timeout
        conn.sock.settimeout(sink.settings.request_timeout)
        self.handler(conn.sock, client_address, self, conn)

    def _handshake(self, conn: _Conn, context: ssl.SSLContext, client_address) -> bool:
        try:
            wrapped = context.wrap_socket(conn.sock, server_side=True, do_handshake_on_connect=False)
        except (ssl.SSLError, OSError) as exc:
            self.sink.count("failures")
            log.debug("TLS from %s failed: %s", client_address[0], exc)
            return False
        with self.slots.lock:  # a cut from now on reaches the wrapped socket
            conn.sock = wrapped
            if conn.gone:
                return False
        try:
            wrapped.do_handshake()
        except (ssl.SSLError, OSError) as exc:
            self.sink.count("failures")
            log.debug("TLS handshake from %s failed: %s", client_address[0], exc)
            return False
        return True

    def handle_error(self, request, client_address) -> None:
        self.sink.count("failures")
        log.debug("error serving %s", client_address[0], exc_info=True)


class _HeadTooLarge(Exception):
    """The request head outgrew ``max_header_bytes``."""


class _BoundedReader:
    """The connection's reader while a request head is parsed: it caps the whole head, where the
    stdlib caps only each line (64 KiB) and the count (100), which let one request hold 6 MiB."""

    def __init__(self, raw, budget: int) -> None:
        self.raw, self.budget = raw, budget

    def readline(self, limit: int = -1) -> bytes:
        line = self.raw.readline(self.budget + 1 if limit < 0 else min(limit, self.budget + 1))
        self.budget -= len(line)
        if self.budget < 0:
            raise _HeadTooLarge
        return line


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "gpumon"
    sys_version = ""

    def __init__(self, request, client_address, server: _Server, conn: _Conn) -> None:
        self.conn = conn
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        # typeshed declares StreamRequestHandler.timeout a ClassVar; setup() reads it from the instance
        self.timeout = self.server.sink.settings.request_timeout  # type: ignore[misc]
        super().setup()

    def handle_one_request(self) -> None:
        """Read one request whose whole head fits ``max_header_bytes``, then answer it as a busy
        connection no newcomer may displace; a kept-alive connection gets a fresh window after."""
        try:
            self._one_request()
        except TimeoutError:
            self.close_connection = True
        finally:
            self.conn.busy = False
            self.conn.deadline = time.monotonic() + self.server.sink.settings.request_timeout

    def _one_request(self) -> None:
        limit = self.server.sink.settings.max_header_bytes
        self.raw_requestline = self.rfile.readline(limit + 1)
        if not self.raw_requestline:
            self.close_connection = True
            return
        if len(self.raw_requestline) > limit:
            self.requestline, self.command, self.request_version = "", "", "HTTP/1.1"
            self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG)
            return
        if not self._parse(limit - len(self.raw_requestline)):
            return
        self.conn.busy = True
        method = getattr(self, "do_" + self.command, None)
        if method is None:
            self.send_error(HTTPStatus.NOT_IMPLEMENTED, f"Unsupported method ({self.command!r})")
            return
        if self._carries_body():  # read as the next request, it would be smuggled past a proxy
            self.send_error(HTTPStatus.BAD_REQUEST, f"A {self.command} request must not carry a body")
            return
        method()
        self.wfile.flush()

    def _parse(self, budget: int) -> bool:
        # parse_request (and http.client.parse_headers) call only readline on rfile
        raw, self.rfile = self.rfile, cast(BufferedIOBase, _BoundedReader(self.rfile, budget))
        try:
            return self.parse_request()
        except _HeadTooLarge:
            self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Request header too large")
            return False
        finally:
            self.rfile = raw

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
        log.debug("%s %s", self.address_string(), format % args)

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    def _denied(self, head: bool) -> bool:
        """Answer 401 or 429 when basic auth is required and not met; True when answered."""
        sink = self.server.sink
        web = sink.web
        if not web.auth_required:
            return False
        verdict = web.verify(self.headers.get("Authorization"), self.conn.source, sink.limiter)
        if verdict is Auth.THROTTLED:
            sink.count("throttled")
            self._send(429, b"Too many failed logins\n", "text/plain; charset=utf-8", head,
                       {"Retry-After": str(sink.limiter.retry_after)})
        elif verdict is Auth.DENIED:
            self._send(401, b"Unauthorized\n", "text/plain; charset=utf-8", head,
                       {"WWW-Authenticate": 'Basic realm="gpumon"'})
        return verdict is not Auth.OK

    def _route(self, head: bool) -> None:
        sink = self.server.sink
        path = self.path.split("?", 1)[0]
        if self._denied(head):
            return
        if path == "/metrics":
            page = sink.page
            if page is None:
                self._send(503, b"no collection yet\n", "text/plain; charset=utf-8", head)
                return
            openmetrics = "application/openmetrics-text" in (self.headers.get("Accept") or "")
            gzipped = accepts_gzip(self.headers.get("Accept-Encoding") or "")
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
        verdict_of = self.server.sink.ctx.health_verdict
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
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if self.request_version == "HTTP/1.0" and not self.close_connection:
            self.send_header("Connection", "keep-alive")  # else a 1.0 keep-alive client waits for EOF
        for name, value in {**self.server.sink.web.headers, **(extra or {})}.items():
            self.send_header(name, value)
        # headers and body in one write: one syscall and one TCP segment train per scrape
        buffered = getattr(self, "_headers_buffer", [])  # HTTP/0.9 requests buffer no headers
        data = b"".join(buffered) + b"\r\n" if buffered else b""
        self._headers_buffer: list[bytes] = []
        self.wfile.write(data if head else data + body)

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


class PrometheusSink(Sink):
    name = "prometheus"
    description = "Serves /metrics (text 0.0.4, OpenMetrics, gzip), /healthz and a landing page."
    options = OPTIONS
    settings: PrometheusSettings

    def __init__(self, ctx, cfg=None) -> None:
        super().__init__(ctx, cfg)
        self.host, self.port = parse_listen(self.settings.listen)
        self.limiter = FailureLimiter(self.settings.auth_failures_per_minute)
        self._compat = DcgmCompat(ctx.hostname) if self.settings.compat == "dcgm-exporter" else None
        self.web = load_web_config(self.settings.web_config_file) if self.settings.web_config_file else WebConfig()
        self._stamp = file_stamp(self.web.files)
        self._reload_log = LogOnce(log)
        self.page: Page | None = None
        self._renderer = Renderer()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._counts = {"scrapes": 0, "failures": 0, "evictions": 0, "throttled": 0}

    def start(self) -> None:
        ipv6 = ":" in self.host
        self._server = _Server((self.host, self.port), _Handler, self, self.settings.backlog, ipv6)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="prometheus-http", daemon=True)
        self._thread.start()
        if self.settings.web_config_file:
            self._watcher = threading.Thread(target=self._watch, name="prometheus-webconfig", daemon=True)
            self._watcher.start()
        scheme = "https" if self.web.ssl_context else "http"
        log.info("serving %s://%s:%d/metrics", scheme, self.host, self.port)

    def listening(self) -> str | None:
        return format_listen(self.host, self.port) if self._server is not None else None

    def refresh(self) -> bool:
        """Load the web config again when it or a file it names changed (a certificate renewed in
        place, a new password): new connections get it, open ones keep theirs. One that does not
        load leaves the running one in place, logged once until it loads. True when swapped."""
        if not self.settings.web_config_file:
            return False
        stamp = file_stamp(self.web.files or (self.settings.web_config_file,))
        if stamp == self._stamp:
            return False
        try:
            web = load_web_config(self.settings.web_config_file)
        except ConfigError as exc:
            self._reload_log.warning("web_config", "web config not reloaded, serving the previous one: %s", exc)
            return False
        # the stamp taken before loading: a change during the load is seen on the next check
        self.web, self._stamp = web, stamp if web.files == self.web.files else file_stamp(web.files)
        self._reload_log.clear()
        log.info("web config %s reloaded", self.settings.web_config_file)
        return True

    def _watch(self) -> None:
        while not self._stopping.wait(self.settings.web_config_check_interval):
            try:
                self.refresh()
            except Exception:  # never let the watcher die: the next check may succeed
                log.exception("checking the web config failed")

    def publish(self, snapshot: Snapshot) -> None:
        text = self._renderer.render(snapshot.families).encode("utf-8")
        self.page = Page(snapshot.families, text, self._compat.render(snapshot) if self._compat else "")

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def count(self, what: str) -> None:
        """One more of ``what``: scrapes, failures, evictions (displaced connections) or throttled."""
        with self._lock:
            self._counts[what] += 1

    def health(self) -> SinkHealth:
        server = self._server
        counts = self._counts
        return SinkHealth(up=server is not None, exported=counts["scrapes"], failed=counts["failures"],
                          detail=f"{counts['evictions']} connections displaced, "
                                 f"{counts['throttled']} logins throttled",
                          extra={"connections": float(len(server.slots))} if server is not None else {})

    def check(self) -> list[CheckResult]:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((self.host, self.port))
            except OSError as exc:
                return [CheckResult("prometheus", False, f"cannot listen on {self.host}:{self.port}: "
                                    f"{exc.strerror or exc}")]
        tls = "TLS" if self.web.ssl_context else "plain HTTP"
        auth = f", basic auth for {len(self.web.users)} user(s)" if self.web.users else ""
        return [CheckResult("prometheus", True, f"can listen on {self.host}:{self.port} ({tls}{auth})")]
