"""The embedded Prometheus endpoint: a page rendered once per snapshot, served from an event loop.

A scrape never triggers a collection: ``publish`` renders the snapshot to text 0.0.4 (and its gzip
twin) and swaps it in (:mod:`.page`); OpenMetrics is rendered on the first scrape that asks for it and
kept with the page. Connections, TLS handshakes and request heads are the front's (:mod:`.front`): an
idle or trickling client costs a file descriptor, never a thread; a complete request is answered by
the routes (:mod:`.server`), in the loop, or on a worker when it needs a bcrypt check.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass

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
from gpumon.model import Snapshot
from gpumon.render import Renderer
from gpumon.sinks.base import CheckResult, Sink, SinkHealth
from gpumon.sinks.prometheus.connections import Limits, connection_cap
from gpumon.sinks.prometheus.dcgm_compat import DcgmCompat
from gpumon.sinks.prometheus.front import Front
from gpumon.sinks.prometheus.page import Page
from gpumon.sinks.prometheus.server import App, listen, source_key
from gpumon.sinks.prometheus.webconfig import (
    FailureLimiter,
    VerifiedStore,
    WebConfig,
    file_stamp,
    load_web_config,
)

__all__ = ["OPTIONS", "PrometheusSettings", "PrometheusSink"]

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
    open_healthz: bool
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
               "its request (at 1-1.25x this, spread). A stalled handshake is closed then; one that has sent "
               "nothing is kept (a descriptor, nothing else) until 300 s while connections are below 3/4 of "
               "`max_connections`, and above that the oldest past this deadline are closed first.",
               min=0.1, max=60.0),
        Option("backlog", int, 4096,
               "Listen backlog: pending connections the kernel queues (capped by "
               "`net.core.somaxconn`, 4096 on current kernels, as Go servers use). Deep enough that "
               "thousands of clients reconnecting at once do not overflow it, which would drop a "
               "scraper's SYN for a second.", min=16, max=65535),
        Option("max_connections", int, 0,
               "Connections held at once; 0: as many as file descriptors allow (the soft `RLIMIT_NOFILE`, "
               "raised to the hard limit at start, less the daemon's own and a reserve of up to 256). A "
               "waiting connection costs a descriptor, no thread. When all are taken, a newcomer "
               "displaces the connection that has sent the least for the longest (never one whose "
               "request is complete), or is closed at once when there is none.", min=0, max=10000000),
        Option("max_connections_per_source", int, 32,
               "Connections one source address (an IPv6 /64) may hold while all `max_connections` are "
               "taken: beyond it a newcomer from that source is closed at once, and cannot displace others.",
               min=1, max=10000000),
        Option("max_header_bytes", int, 16384,
               "Largest request head (request line and all headers) read; a larger one gets `431` and "
               "the connection is closed.", min=1024, max=262144),
        Option("auth_failures_per_minute", float, 30.0,
               "Failed basic-auth checks (a bcrypt check each) one source address may cost per minute for "
               "one user name (all unknown names share one budget), with a burst of ten seconds' worth; "
               "beyond it the source gets `429` without a check. Credentials verified once are remembered "
               "(as an HMAC keyed by a file in the state directory, across restarts) and never limited.",
               min=1.0, max=60000.0),
        Option("open_healthz", bool, False,
               "Answer `/healthz` (liveness: `ok` or `503`, nothing else) without basic auth, so "
               "Kubernetes probes keep working when `basic_auth_users` is set; every other path still "
               "needs credentials. The shipped DaemonSet turns it on."),
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
        self._verified = VerifiedStore(ctx.state_dir)
        self.web = load_web_config(self.settings.web_config_file) if self.settings.web_config_file else WebConfig()
        self._stamp = file_stamp(self.web.files)
        self._reload_log = LogOnce(log)
        self.page: Page | None = None
        self._renderer = Renderer()
        self._server: Front | None = None
        self._watcher: threading.Thread | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._counts = {"scrapes": 0, "failures": 0, "evictions": 0, "throttled": 0}

    def start(self) -> None:
        listener = listen(self.host, self.port, self.settings.backlog)
        self.web.remember(self._verified)  # here, not in __init__: `gpumon check` writes nothing
        self.port = listener.getsockname()[1]
        settings = self.settings
        limits = Limits(settings.first_byte_timeout, settings.request_timeout, settings.max_header_bytes,
                        connection_cap(settings.max_connections), settings.max_connections_per_source,
                        settings.backlog)
        self._server = Front(listener, App(self), limits, lambda: self.web.ssl_context, self.count, source_key)
        self._server.start()
        if self.settings.web_config_file:
            self._watcher = threading.Thread(target=self._watch, name="prometheus-webconfig", daemon=True)
            self._watcher.start()
        scheme = "https" if self.web.ssl_context else "http"
        log.info("serving %s://%s:%d/metrics (up to %d connections)", scheme, self.host, self.port,
                 limits.max_connections)

    @property
    def bound_address(self) -> tuple[str, int]:
        """(host, port) actually listened on: with ``--listen HOST:0`` the port the kernel picked."""
        return self.host, self.port

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
        web.remember(self._verified)
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
            self._server.stop(timeout)
            self._server = None

    def count(self, what: str) -> None:
        """One more of ``what``: scrapes, failures, evictions (displaced connections) or throttled."""
        with self._lock:
            self._counts[what] += 1

    def health(self) -> SinkHealth:
        server = self._server
        counts = self._counts
        return SinkHealth(up=server is not None and server.thread.is_alive(), exported=counts["scrapes"], failed=counts["failures"],
                          detail=f"{counts['evictions']} connections displaced, "
                                 f"{counts['throttled']} logins throttled, "
                                 f"{server.refused if server is not None else 0} connections refused",
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
