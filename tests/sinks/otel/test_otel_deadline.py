"""Every export has a whole-request deadline, and the sink is not up before its first success.

A socket timeout bounds each read, not the request: a server that answers one byte at a time, each
well inside the timeout, would otherwise hold the export thread forever while health says up."""

from __future__ import annotations

import time

import pytest

from tests.conftest import wait_for
from tests.fakes import otlp as receivers
from tests.fakes.otlp import TricklingServer
from tests.support.otel import make_sink, snapshot

grpc_receiver = receivers.grpc_receiver


@pytest.fixture
def trickling():
    server = TricklingServer()
    yield server
    server.close()


def test_a_trickling_http_endpoint_fails_each_export_at_its_deadline(trickling, tmp_path):
    sink = make_sink(trickling.endpoint, tmp_path, timeout=1.0, logs=False)
    assert not sink.health().up  # not started
    sink.start()
    try:
        assert not sink.health().up  # started, nothing accepted yet: not up
        sink.publish(snapshot(time.time(), 1.0, 1.0))
        wait_for(lambda: sink.health().failed >= 2, timeout=8)
        health = sink.health()
        assert not health.up
        assert health.exported == 0
        assert "1 s deadline" in health.detail
        with trickling.cond:
            held = list(trickling.held)
        assert held, "the client never let go of a connection"
        # each connection was given up at the 1 s deadline (plus scheduling), though every byte came
        # well inside the per-read timeout
        assert all(0.9 <= h < 2.5 for h in held), held
    finally:
        started = time.monotonic()
        sink.stop(1)
        assert time.monotonic() - started < 1.6


def test_a_stalled_grpc_endpoint_fails_each_export_at_its_deadline(grpc_receiver, tmp_path):
    grpc_receiver.delay = 30  # the handler sits on the call; released when the receiver closes
    sink = make_sink(grpc_receiver.endpoint, tmp_path, protocol="grpc", timeout=1.0, logs=False)
    sink.start()
    try:
        assert not sink.health().up
        started = time.monotonic()
        sink.publish(snapshot(time.time(), 1.0, 1.0))
        wait_for(lambda: sink.health().failed >= 1, timeout=8)
        assert time.monotonic() - started < 2.5
        health = sink.health()
        assert not health.up and health.exported == 0
        assert "DEADLINE_EXCEEDED" in health.detail
    finally:
        sink.stop(1)


def test_up_after_the_first_accepted_export_and_down_after_a_failure(tmp_path):
    receiver = receivers.OtlpHttpReceiver()
    sink = make_sink(receiver.endpoint, tmp_path, logs=False)
    sink.start()
    try:
        assert not sink.health().up
        sink.publish(snapshot(time.time(), 1.0, 1.0, seq=0))
        wait_for(lambda: sink.health().up, timeout=8)
        assert sink.health().extra["exported_data_points"] > 0
        receiver.answers = [400] * 100
        sink.publish(snapshot(time.time(), 2.0, 2.0, seq=1))
        wait_for(lambda: sink.health().failed >= 1, timeout=8)
        health = sink.health()
        assert not health.up and "HTTP 400" in health.detail
    finally:
        sink.stop(1)
        receiver.close()
