"""The embedded endpoint over real sockets: negotiation, health, and clients that misbehave."""

from __future__ import annotations

import gzip
import socket
import threading
import time

import pytest

from gpumon.sinks.base import SinkContext
from gpumon.sinks.prometheus import PrometheusSink
from tests.conftest import http_get, wait_for
from tests.support.endpoint import raw, section, snapshot


@pytest.fixture
def sink():
    alive = {"value": True}
    made = []

    def make(**values) -> PrometheusSink:
        s = PrometheusSink(SinkContext("host", "/tmp", "9.9", loop_alive=lambda: alive["value"]), section(**values))
        s.alive = alive
        s.start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def url(s: PrometheusSink, path: str = "/metrics") -> str:
    return f"http://127.0.0.1:{s.port}{path}"


def test_no_page_yet_is_503_then_text_format(sink):
    s = sink()
    assert http_get(url(s))[0] == 503
    s.publish(snapshot())
    status, headers, body = http_get(url(s))
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert b'gpumon_test_value{i="49"} 49\n' in body


def test_openmetrics_and_gzip_by_headers(sink):
    s = sink()
    s.publish(snapshot())
    status, headers, body = http_get(url(s), {"Accept": "application/openmetrics-text; version=1.0.0",
                                             "Accept-Encoding": "gzip"})
    assert status == 200 and headers["Content-Encoding"] == "gzip"
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert gzip.decompress(body).endswith(b"# EOF\n")


def test_scrape_serves_the_page_it_was_given_and_counts(sink):
    s = sink()
    s.publish(snapshot(3))
    for _ in range(3):
        http_get(url(s))
    s.publish(snapshot(5))
    assert b'i="4"' in http_get(url(s))[2]
    wait_for(lambda: s.health().exported == 4)  # counted once the body is written


def test_healthz_follows_the_loop_and_landing_page(sink):
    s = sink()
    assert http_get(url(s, "/healthz"))[0] == 200
    s.alive["value"] = False
    assert http_get(url(s, "/healthz"))[0] == 503
    status, _, body = http_get(url(s, "/"))
    assert status == 200 and b'href="/metrics"' in body and b"9.9" in body
    assert http_get(url(s, "/nope"))[0] == 404


def test_garbage_and_oversize_requests_are_answered_without_harm(sink):
    s = sink(request_timeout=1.0)
    s.publish(snapshot())
    assert b"Error code: 400" in raw(s, b"\x16\x03\x01garbage\r\n\r\n")
    assert raw(s, b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n").startswith(b"HTTP/1.1 431")
    many = b"".join(b"X-%d: y\r\n" % i for i in range(200))
    assert raw(s, b"GET /metrics HTTP/1.1\r\n" + many + b"\r\n").startswith(b"HTTP/1.1 431")
    assert raw(s, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n").startswith(b"HTTP/1.1 501")
    assert http_get(url(s))[0] == 200


def test_idle_and_slow_clients_do_not_block_scrapes(sink):
    s = sink(request_timeout=2.0)
    s.publish(snapshot())
    idle = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(20)]
    half = socket.create_connection(("127.0.0.1", s.port))
    half.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
    try:
        t0 = time.monotonic()
        for _ in range(10):
            assert http_get(url(s), timeout=2)[0] == 200
        assert time.monotonic() - t0 < 2.0
        # the unfinished head is closed after request_timeout; the idle ones (nothing sent) are kept
        # while descriptors are plentiful: closing them would only make their clients reconnect
        half.settimeout(5)
        assert half.recv(1) == b""
        idle[0].setblocking(False)
        with pytest.raises(BlockingIOError):
            idle[0].recv(1)
    finally:
        for conn in idle + [half]:
            conn.close()


def test_concurrent_scrapes_all_succeed(sink):
    s = sink()
    s.publish(snapshot(2000))
    results: list[int] = []
    lock = threading.Lock()

    def scrape() -> None:
        for _ in range(5):
            status = http_get(url(s), timeout=10)[0]
            with lock:
                results.append(status)

    threads = [threading.Thread(target=scrape) for _ in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [200] * 320


def test_port_in_use_fails_start_and_check(sink):
    s = sink()
    other = PrometheusSink(SinkContext("h", "/tmp", "1"), section(listen=f"127.0.0.1:{s.port}"))
    [verdict] = other.check()
    assert not verdict.ok and "cannot listen" in verdict.message
    with pytest.raises(OSError):
        other.start()


def test_head_request_has_no_body(sink):
    s = sink()
    s.publish(snapshot())
    reply = raw(s, b"HEAD /metrics HTTP/1.0\r\n\r\n")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and body == b""
    wait_for(lambda: s.health().exported >= 1)


def test_a_request_trickled_slower_than_the_deadline_is_cut(sink):
    s = sink(request_timeout=1.0)
    s.publish(snapshot())
    conn = socket.create_connection(("127.0.0.1", s.port), timeout=5)
    t0 = time.monotonic()
    try:
        for ch in b"GET /metrics HTTP/1.1\r\nHost: x\r\n":  # one byte every 0.2 s, each read within timeout
            conn.send(bytes([ch]))
            time.sleep(0.2)  # the client's pace is what this test is about
    except OSError:
        pass  # cut by the server
    finally:
        conn.close()
    assert time.monotonic() - t0 < 3.0
    assert s.health().failed >= 1


def test_connections_beyond_the_cap_are_closed_and_scrapes_resume(sink):
    s = sink(max_connections=4, max_connections_per_source=4, request_timeout=5.0)
    s.publish(snapshot())
    idle = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(4)]
    try:
        extra = socket.create_connection(("127.0.0.1", s.port), timeout=5)
        assert extra.recv(1) == b""  # closed at once, not queued behind the idle ones
        extra.close()
    finally:
        for conn in idle:
            conn.close()
    def scrape_ok() -> bool:
        try:
            return http_get(url(s), timeout=2)[0] == 200
        except OSError:  # still at the cap for a moment while the server sees the closes
            return False

    wait_for(scrape_ok)


def test_gzip_refused_with_q0_and_vary_is_set(sink):
    s = sink()
    s.publish(snapshot())
    status, headers, body = http_get(url(s), {"Accept-Encoding": "gzip;q=0, identity"})
    assert status == 200 and "Content-Encoding" not in headers and body.startswith(b"# HELP")
    assert headers["Vary"] == "Accept, Accept-Encoding"


def test_http_10_keep_alive_and_http_09(sink):
    s = sink(request_timeout=5.0)
    s.publish(snapshot())
    with socket.create_connection(("127.0.0.1", s.port), timeout=5) as conn:
        for _ in range(2):  # two requests on one HTTP/1.0 keep-alive connection
            conn.sendall(b"GET /metrics HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(4096)
            headers, _, body = head.partition(b"\r\n\r\n")
            assert b"Connection: keep-alive" in headers
            length = int(next(line.split(b":")[1] for line in headers.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(body) < length:
                body += conn.recv(65536)
    reply = raw(s, b"GET /metrics\r\n\r\n")  # HTTP/0.9: the body alone, then close
    assert reply.startswith(b"# HELP gpumon_test_value")
