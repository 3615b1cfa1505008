"""The embedded Prometheus endpoint: a page rendered once per snapshot, served by a threaded server.

A scrape never triggers a collection: ``publish`` renders the snapshot to text 0.0.4 (and its gzip
twin) and swaps it in; OpenMetrics is rendered on the first scrape that asks for it and kept with
the page. Each connection gets its own thread, its own socket timeout and, with TLS, its own
handshake, so an idle or garbage-sending client cannot hold up other scrapes.
"""

from __future__ import annotations

import gzip
import html
import logging
import queue
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gpumon.config import Option, SectionSchema, listen_check, parse_listen
from gpumon.model import MetricFamily, Snapshot
from gpumon.render import OPENMETRICS_CONTENT_TYPE, TEXT_CONTENT_TYPE, Renderer
from gpumon.sinks.base import CheckResult, Sink, SinkHealth
from gpumon.sinks.webconfig import WebConfig, load_web_config

log = logging.getLogger("gpumon.sinks.prometheus")

OPTIONS = SectionSchema(
    "prometheus",
    "The embedded Prometheus endpoint (the default sink).",
    (
        Option("listen", str, "0.0.0.0:9470", "Address and port to serve /metrics on; `[::]:9470` for IPv6.",
               check=listen_check),
        Option("web_config_file", str, "",
               "Exporter-toolkit web config (YAML) with `tls_server_config` and `basic_auth_users`, the "
               "same file node_exporter takes as `--web.config.file`. Empty: plain HTTP, no auth."),
        Option("request_timeout", float, 10.0,
               "Seconds a connection may stay idle or take to send its request before it is closed.",
               min=0.1, max=300.0),
        Option("backlog", int, 256, "Listen backlog: pending connections the kernel queues.",
               min=16, max=65535),
        Option("max_connections", int, 128,
               "Connections served at once; more are closed at once, so slow or flooding clients cannot "
               "exhaust threads and file descriptors.", min=1, max=10000),
    ),
)

LANDING = """<!doctype html>
<html><head><title>gpumon</title></head>
<body><h1>gpumon {version}</h1>
<p>GPU and InfiniBand telemetry for {host}.</p>
<ul><li><a href="/metrics">/metrics</a></li><li><a href="/healthz">/healthz</a></li></ul>
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
    """One snapshot's exposition in every variant a scraper may ask for, built at most once each."""

    def __init__(self, families: tuple[MetricFamily, ...], text: bytes) -> None:
        self._families = families
        self._bodies: dict[tuple[bool, bool], bytes] = {(False, False): text}
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
                    found = Renderer().render(self._families, openmetrics=True).encode("utf-8")
                self._bodies[key] = found
            return found


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, address, handler, sink: PrometheusSink, backlog: int, ipv6: bool) -> None:
        self.address_family = socket.AF_INET6 if ipv6 else socket.AF_INET
        self.request_queue_size = backlog
        self.sink = sink
        self.slots = threading.BoundedSemaphore(sink.max_connections)
        self.deadlines: dict[socket.socket, float] = {}
        self.deadlines_lock = threading.Lock()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.idle = 0
        self.idle_lock = threading.Lock()
        self.closed = False
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
        """On the accept thread. A connection beyond ``max_connections`` is closed, not queued.
        Otherwise it goes to an idle connection thread, or to a new one when none is idle: starting
        a thread per scrape was most of the accept loop's time under load (docs/performance.md),
        and every connection still has a thread of its own, so an idle client holds only that."""
        if not self.slots.acquire(blocking=False):
            self.sink.count_failure()
            self.shutdown_request(request)
            return
        with self.idle_lock:
            reuse = self.idle > 0
            if reuse:
                self.idle -= 1  # reserved: that thread will take this job off the queue
        if reuse:
            self.jobs.put((request, client_address))
            return
        try:
            threading.Thread(target=self._serve, args=(request, client_address), name="prometheus-conn",
                             daemon=True).start()
        except BaseException:
            self.slots.release()
            self.shutdown_request(request)
            raise

    def _serve(self, request, client_address) -> None:
        while True:
            try:
                self.finish_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)
                self.slots.release()
            if self.closed:
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
            request, client_address = job

    def server_close(self) -> None:
        self.closed = True
        super().server_close()
        with self.idle_lock:
            idle, self.idle = self.idle, 0
        for _ in range(idle):  # wake the idle threads so they exit
            self.jobs.put(None)

    def arm(self, conn: socket.socket) -> None:
        """(Re)start the clock for one request: it must be read and answered within request_timeout."""
        with self.deadlines_lock:
            self.deadlines[conn] = time.monotonic() + self.sink.request_timeout

    def disarm(self, conn: socket.socket) -> None:
        with self.deadlines_lock:
            self.deadlines.pop(conn, None)

    def _reap(self) -> None:
        """Cut connections that trickle a request slower than the per-read socket timeout can see."""
        while True:
            time.sleep(0.25)
            now = time.monotonic()
            with self.deadlines_lock:
                late = [conn for conn, deadline in self.deadlines.items() if deadline < now]
                for conn in late:
                    del self.deadlines[conn]
            for conn in late:
                self.sink.count_failure()
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def finish_request(self, request, client_address) -> None:
        """Runs on the connection's own thread: the TLS handshake happens here, never in accept."""
        sink = self.sink
        request.settimeout(sink.request_timeout)
        self.arm(request)
        try:
            context = sink.web.ssl_context
            if context is not None:
                try:
                    wrapped = context.wrap_socket(request, server_side=True)
                except (ssl.SSLError, OSError) as exc:
                    sink.count_failure()
                    log.debug("TLS handshake from %s failed: %s", client_address[0], exc)
                    return
                self.disarm(request)
                request = wrapped
                self.arm(request)
            try:
                self.RequestHandlerClass(request, client_address, self)
            finally:
                if context is not None:
                    try:
                        request.close()
                    except OSError:
                        pass
        finally:
            self.disarm(request)

    def handle_error(self, request, client_address) -> None:
        self.sink.count_failure()
        log.debug("error serving %s", client_address[0], exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "gpumon"
    sys_version = ""

    def setup(self) -> None:
        self.timeout = self.server.sink.request_timeout
        super().setup()

    def handle_one_request(self) -> None:
        super().handle_one_request()
        self.server.arm(self.connection)  # a kept-alive connection gets a fresh window for the next

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s %s", self.address_string(), format % args)

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    def _route(self, head: bool) -> None:
        sink = self.server.sink
        path = self.path.split("?", 1)[0]
        if sink.web.auth_required and not sink.web.authorized(self.headers.get("Authorization")):
            self._send(401, b"Unauthorized\n", "text/plain; charset=utf-8", head,
                       {"WWW-Authenticate": 'Basic realm="gpumon"'})
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
            sink.count_scrape()
        elif path == "/healthz":
            if sink.ctx.loop_alive():
                self._send(200, b"ok\n", "text/plain; charset=utf-8", head)
            else:
                self._send(503, b"collector loop is not running\n", "text/plain; charset=utf-8", head)
        elif path == "/":
            body = LANDING.format(version=html.escape(sink.ctx.version), host=html.escape(sink.ctx.hostname))
            self._send(200, body.encode("utf-8"), "text/html; charset=utf-8", head)
        else:
            self._send(404, b"not found\n", "text/plain; charset=utf-8", head)

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
        self._headers_buffer = []
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

    def __init__(self, ctx, cfg=None) -> None:
        super().__init__(ctx, cfg)
        values = OPTIONS.values(cfg)
        self.host, self.port = parse_listen(values["listen"])
        self.request_timeout = float(values["request_timeout"])
        self.backlog = int(values["backlog"])
        self.max_connections = int(values["max_connections"])
        self.web = load_web_config(values["web_config_file"]) if values["web_config_file"] else WebConfig()
        self.page: Page | None = None
        self._renderer = Renderer()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._scrapes = 0
        self._failures = 0

    def start(self) -> None:
        ipv6 = ":" in self.host
        self._server = _Server((self.host, self.port), _Handler, self, self.backlog, ipv6)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="prometheus-http", daemon=True)
        self._thread.start()
        scheme = "https" if self.web.ssl_context else "http"
        log.info("serving %s://%s:%d/metrics", scheme, self.host, self.port)

    def publish(self, snapshot: Snapshot) -> None:
        text = self._renderer.render(snapshot.families).encode("utf-8")
        self.page = Page(snapshot.families, text)

    def stop(self, timeout: float = 5.0) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def count_scrape(self) -> None:
        with self._lock:
            self._scrapes += 1

    def count_failure(self) -> None:
        with self._lock:
            self._failures += 1

    def health(self) -> SinkHealth:
        return SinkHealth(up=self._server is not None, exported=self._scrapes, failed=self._failures)

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
