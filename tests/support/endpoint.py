"""The Prometheus endpoint as its tests drive it: a sink on 127.0.0.1:0 with a page of ``n`` series,
raw bytes over a socket, a bounded flood of reconnecting sockets from other loopback sources, and
TLS (web.yml, client contexts) from a throwaway CA."""

from __future__ import annotations

import selectors
import socket
import ssl
import threading
import time

import pytest

from gpumon.config import Section
from gpumon.model import MetricFamily, MetricSpec, MetricType, Snapshot
from gpumon.sinks.base import SinkContext
from gpumon.sinks.prometheus import OPTIONS, PrometheusSink

SPEC = MetricSpec("gpumon_test_value", MetricType.GAUGE, "A value.", labels=("i",))


def snapshot(n: int = 50) -> Snapshot:
    fam = MetricFamily(SPEC, tuple(SPEC.sample(i, str(i)) for i in range(n)))
    return Snapshot("host", time.time(), (fam,), (), ())


def section(**values) -> Section:
    defaults = {o.key: o.default for o in OPTIONS.options}
    defaults.update({"listen": "127.0.0.1:0", **values})
    return Section("prometheus", defaults)


def raw(s: PrometheusSink, data: bytes, read: bool = True, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", s.port), timeout=timeout) as conn:
        conn.sendall(data)
        if not read:
            return b""
        chunks = []
        try:
            while True:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except TimeoutError:
            pass
        return b"".join(chunks)


class Flood:
    """``count`` sockets spread over ``sources`` that connect, send ``payload`` (or nothing) and
    reconnect as soon as the server closes them, on a thread of their own until ``stop``."""

    def __init__(self, port: int, count: int, sources: list[str], payload: bytes = b"") -> None:
        self.port, self.count, self.sources, self.payload = port, count, sources, payload
        self.reconnects = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Flood:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _connect(self, selector: selectors.BaseSelector, i: int) -> None:
        try:
            conn = socket.create_connection(("127.0.0.1", self.port), timeout=1,
                                            source_address=(self.sources[i % len(self.sources)], 0))
            if self.payload:
                conn.sendall(self.payload)
        except OSError:
            return
        conn.setblocking(False)
        selector.register(conn, selectors.EVENT_READ, i)

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        for i in range(self.count):
            self._connect(selector, i)
        deadline = time.monotonic() + 15
        while not self._stop.is_set() and time.monotonic() < deadline:
            live = {key.data for key in selector.get_map().values()}
            for i in set(range(self.count)) - live:  # refused or failed: try again
                self._connect(selector, i)
            for key, _ in selector.select(0.05):
                try:
                    data = key.fileobj.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    selector.unregister(key.fileobj)
                    key.fileobj.close()
                    self.reconnects += 1
                    self._connect(selector, key.data)
        for key in list(selector.get_map().values()):
            key.fileobj.close()
        selector.close()


def start_sink(**values) -> PrometheusSink:
    s = PrometheusSink(SinkContext("host", "/tmp", "9.9"), section(**values))
    s.start()
    s.publish(snapshot())
    return s


@pytest.fixture
def sinks():
    """Start endpoint sinks (``sinks(**options)``); each is stopped when the test ends."""
    made: list[PrometheusSink] = []

    def make(**values) -> PrometheusSink:
        made.append(start_sink(**values))
        return made[-1]

    yield make
    for s in made:
        s.stop()


def write_tls(directory, ca, client_auth: bool = False, users: str = "") -> str:
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(directory / "server.pem"))
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    text = "tls_server_config:\n  cert_file: server.pem\n  key_file: server.pem\n"
    if client_auth:
        text += "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.pem\n"
    if users:
        text += f"basic_auth_users:\n  prometheus: '{users}'\n"
    (directory / "web.yml").write_text(text)
    return str(directory / "web.yml")


def client(ca, with_cert: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    if with_cert:
        ca.issue_cert("scraper").configure_cert(ctx)
    return ctx
