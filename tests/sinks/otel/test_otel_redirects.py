"""The OTLP/HTTP export and redirects: a 307/308 to the same origin is followed (same method, body and
headers, within the one deadline); any other redirect is a failed export, counted, logged once, the
sink down, and nothing (credentials least of all) is sent to the place it names."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.fakes.otlp import RecordingServer, RedirectingReceiver, TricklingServer
from tests.support.otel import POINTS, make_sink, snapshot

TOKEN = "Bearer s3cret-redirect-token"


@pytest.fixture
def elsewhere():
    server = RecordingServer()
    yield server
    server.close()


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_to_another_origin_fails_the_export_and_sends_nothing_there(status, elsewhere, tmp_path,
                                                                               caplog):
    hostile = RedirectingReceiver({"/v1/metrics": (status, elsewhere.origin + "/collect")})
    sink = make_sink(hostile.endpoint, tmp_path, logs=False, headers=[f"Authorization={TOKEN}"])
    sink.config_backoff_min = 0.05
    sink.start()
    try:
        with caplog.at_level(logging.WARNING, logger="gpumon.sinks.otel"):
            for i in range(3):
                sink.publish(snapshot(time.time(), 1.0 + i, 1.0 + i, seq=i))
                wait_for(lambda n=i: sink.health().failed >= n + 1, timeout=10)
        health = sink.health()
    finally:
        sink.stop(1)
        hostile.close()
    assert elsewhere.requests == []  # no GET, no POST, no credentials: the other origin saw nothing
    assert not health.up and health.exported == 0
    assert f"HTTP {status}" in health.detail and "redirect" in health.detail
    lines = [r.getMessage() for r in caplog.records if "redirect" in r.getMessage()]
    assert len(lines) == 1, lines  # logged once for the whole streak
    assert "s3cret" not in caplog.text


def test_a_redirect_to_another_scheme_on_the_same_host_and_port_is_not_followed(tmp_path):
    """Another scheme is another origin, even for the same host and port (RFC 6454)."""
    hostile = RedirectingReceiver({})
    hostile.routes["/v1/metrics"] = (308, hostile.endpoint.replace("http://", "https://") + "/v1/metrics")
    sink = make_sink(hostile.endpoint, tmp_path, logs=False, headers=[f"Authorization={TOKEN}"])
    sink.start()
    try:
        sink.publish(snapshot(time.time(), 1.0, 1.0))
        wait_for(lambda: sink.health().failed >= 1, timeout=10)
        assert "another origin" in sink.health().detail and not sink.health().up
        with hostile.lock:
            assert len(hostile.hits) == 1
    finally:
        sink.stop(1)
        hostile.close()


def test_a_307_or_308_to_the_same_origin_is_followed_with_method_body_and_headers(tmp_path):
    hostile = RedirectingReceiver({"/old/v1/metrics": (307, "/v1/../moved/v1/metrics")})
    hostile.routes["/moved/v1/metrics"] = (308, hostile.endpoint + "/v1/metrics#fragment")
    sink = make_sink(hostile.endpoint + "/old", tmp_path, logs=False, headers=[f"Authorization={TOKEN}"])
    sink.start()
    try:
        sink.publish(snapshot(time.time(), 1.0, 1.0))
        wait_for(lambda: sink.health().up, timeout=10)
        assert sink.health().exported == POINTS
        with hostile.lock:
            hits = list(hostile.hits)
    finally:
        sink.stop(1)
        hostile.close()
    assert [path for path, _ in hits] == ["/old/v1/metrics", "/moved/v1/metrics", "/v1/metrics"]
    assert all(auth == TOKEN for _, auth in hits)
    assert len(hostile.real.metrics) == 1


def test_a_redirect_loop_is_a_failed_export_after_a_few_hops(tmp_path):
    hostile = RedirectingReceiver({"/v1/metrics": (307, "/v1/metrics")})
    sink = make_sink(hostile.endpoint, tmp_path, logs=False)
    sink.start()
    try:
        sink.publish(snapshot(time.time(), 1.0, 1.0))
        wait_for(lambda: sink.health().failed >= 1, timeout=10)
        assert "redirects" in sink.health().detail and not sink.health().up
        with hostile.lock:
            hits = len(hostile.hits)
    finally:
        sink.stop(1)
        hostile.close()
    assert hits == 4  # the request and three redirects followed


def test_a_trickling_redirect_target_on_another_origin_is_never_contacted(tmp_path):
    trickler = TricklingServer()
    hostile = RedirectingReceiver({"/v1/metrics": (302, trickler.endpoint + "/slow")})
    sink = make_sink(hostile.endpoint, tmp_path, logs=False, timeout=1.0)
    sink.start()
    try:
        started = time.monotonic()
        sink.publish(snapshot(time.time(), 1.0, 1.0))
        wait_for(lambda: sink.health().failed >= 1, timeout=5)
        assert time.monotonic() - started < 1.5
    finally:
        sink.stop(1)
        hostile.close()
        trickler.close()
    assert trickler.accepted == 0


def test_the_deadline_covers_a_followed_redirect_into_a_trickle(tmp_path):
    """A same-origin 307 whose target trickles its answer: the export ends at its one deadline, counted
    from the first request, not a fresh one per hop."""
    trickler = TricklingServer()
    redirect = (b"HTTP/1.1 307 Temporary Redirect\r\nLocation: /slow\r\nContent-Length: 0\r\n\r\n")
    trickler_first = {"done": False}
    original = trickler._trickle

    def first_redirects(conn: Any) -> None:  # the first connection redirects, the second trickles
        if not trickler_first["done"]:
            trickler_first["done"] = True
            with conn:
                conn.recv(1 << 20)
                conn.sendall(redirect)
                try:
                    conn.recv(1 << 20)  # the client's next request on the kept connection, if any
                except OSError:
                    pass
            return
        original(conn)

    trickler._trickle = first_redirects  # type: ignore[method-assign]
    sink = make_sink(trickler.endpoint, tmp_path, logs=False, timeout=1.0, backoff_initial=30, backoff_max=60)
    sink.start()
    try:
        started = time.monotonic()
        sink.publish(snapshot(time.time(), 1.0, 1.0))
        wait_for(lambda: sink.health().failed >= 1, timeout=8)
        took = time.monotonic() - started
        assert "1 s deadline" in sink.health().detail and not sink.health().up
        assert took < 2.0, took
        wait_for(lambda: trickler.held, timeout=5)
        with trickler.cond:
            held = list(trickler.held)
    finally:
        sink.stop(1)
        trickler.close()
    assert all(h < 1.5 for h in held), held  # the trickle was cut at what was left of the 1 s
