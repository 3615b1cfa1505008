"""A collector that is down, slow, or answers 503 costs the daemon nothing: publish() stays instant,
exports are retried with backoff and counted, and stop() keeps its deadline."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("opentelemetry.proto")

from gpumon.model import Event, Severity  # noqa: E402
from tests import test_otel_receiver as receivers  # noqa: E402
from tests.conftest import free_port, wait_for  # noqa: E402
from tests.test_otel_export_wire import snapshot  # noqa: E402
from tests.test_otel_receiver import make_sink  # noqa: E402

# The receivers' fixtures, shared with this module.
grpc_receiver = receivers.grpc_receiver
http_receiver = receivers.http_receiver


def event(i: int) -> Event:
    return Event("ib_link_flap", Severity.WARNING, {"device": "mlx5_ib0", "port": "1"}, f"flap {i}", time=1.0 + i)


def publish_many(sink, n: int, with_events: bool = False) -> float:
    """Publish ``n`` fresh snapshots; return the slowest publish() in seconds."""
    worst = 0.0
    for i in range(n):
        snap = snapshot(time.time(), 1.0 + i, 1.0 + i, events=(event(i),) if with_events else (), seq=i)
        started = time.perf_counter()
        sink.publish(snap)
        worst = max(worst, time.perf_counter() - started)
    return worst


def test_endpoint_down_is_counted_and_never_blocks_publish(tmp_path):
    sink = make_sink(f"http://127.0.0.1:{free_port()}", tmp_path, max_queued_records=5)
    sink.start()
    try:
        worst = publish_many(sink, 50, with_events=True)
        wait_for(lambda: sink.health().failed >= 2, timeout=10)
        health = sink.health()
        assert not health.up
        assert "refused" in health.detail.lower()
        assert health.exported == 0
        assert health.dropped >= 45  # 45 events beyond the queue of 5, plus superseded snapshots
        assert health.extra["queued_records"] == 5
        assert worst < 0.05, f"publish took {worst * 1000:.1f} ms"
    finally:
        started = time.monotonic()
        sink.stop(2)
        assert time.monotonic() - started < 3


def test_503_is_retried_with_backoff_until_accepted(http_receiver, tmp_path):
    http_receiver.answers = [503, 503]
    sink = make_sink(http_receiver.endpoint, tmp_path)
    sink.start()
    try:
        sink.publish(snapshot(time.time(), 1.0, 1.0, events=(event(0),)))
        http_receiver.wait(lambda r: r.metrics and r.logs)
        wait_for(lambda: sink.health().extra["exported_log_records"] and sink.health().up, timeout=10)
        health = sink.health()
        assert health.failed == 2 and health.up
        assert health.extra["exported_log_records"] == 1  # the record survived the 503s
        assert health.extra["consecutive_failures"] == 0
    finally:
        sink.stop(2)
    assert http_receiver.attempts == 4  # 2 x 503 (shared by both signals, in any order), then one each


def test_retry_after_is_honoured(http_receiver, tmp_path):
    http_receiver.answers = [429]
    http_receiver.retry_after = "0.6"
    sink = make_sink(http_receiver.endpoint, tmp_path, logs=False, backoff_initial=0.01, backoff_max=5)
    sink.start()
    try:
        sink.publish(snapshot(time.time(), 1.0, 1.0))
        http_receiver.wait(lambda r: r.metrics)
    finally:
        sink.stop(2)
    assert http_receiver.attempt_times[1] - http_receiver.attempt_times[0] >= 0.55


def test_slow_collector_times_out_without_holding_publish_or_stop(http_receiver, tmp_path):
    http_receiver.delay = 30  # released when the receiver closes
    http_receiver.answers = [503] * 1000
    sink = make_sink(http_receiver.endpoint, tmp_path, timeout=0.3)
    sink.start()
    try:
        worst = publish_many(sink, 20, with_events=True)
        assert worst < 0.05
        wait_for(lambda: sink.health().failed >= 2, timeout=10)
        assert "timed out" in sink.health().detail.lower() or "timeout" in sink.health().detail.lower()
    finally:
        started = time.monotonic()
        sink.stop(1)
        assert time.monotonic() - started < 1.6


def test_rejected_request_is_dropped_not_retried(http_receiver, tmp_path):
    http_receiver.answers = [400]
    sink = make_sink(http_receiver.endpoint, tmp_path, logs=False)
    sink.start()
    try:
        sink.publish(snapshot(time.time(), 1.0, 1.0, seq=1))
        wait_for(lambda: sink.health().failed == 1, timeout=10)
        assert sink.health().dropped == 17
        sink.publish(snapshot(time.time(), 2.0, 2.0, seq=2))
        http_receiver.wait(lambda r: r.metrics)
    finally:
        sink.stop(2)
    point = http_receiver.metric_points()["hw.energy"][0][0].sum.data_points[0]
    assert point.as_double == 2.0  # the rejected snapshot was not sent again
    assert http_receiver.attempts == 2


def test_grpc_unavailable_is_retried(grpc_receiver, tmp_path):
    grpc_receiver.answers = [503]  # the receiver aborts with UNAVAILABLE
    sink = make_sink(grpc_receiver.endpoint, tmp_path, protocol="grpc", logs=False)
    sink.start()
    try:
        sink.publish(snapshot(time.time(), 1.0, 1.0))
        grpc_receiver.wait(lambda r: r.metrics)
        wait_for(lambda: sink.health().exported == 17, timeout=10)
        assert sink.health().failed == 1 and sink.health().up
    finally:
        sink.stop(2)


def test_stop_flushes_queued_events(http_receiver, tmp_path):
    sink = make_sink(http_receiver.endpoint, tmp_path, backoff_initial=30, backoff_max=60)
    http_receiver.answers = [503]
    sink.start()
    try:
        sink.publish(snapshot(time.time(), 1.0, 1.0, events=(event(0),)))
        wait_for(lambda: sink.health().failed == 1, timeout=10)
    finally:
        sink.stop(3)  # the 30 s backoff is cut short: shutdown sends what is pending once
    assert len(http_receiver.log_records()) == 1 or len(http_receiver.metrics) == 1
    assert sink.health().extra["queued_records"] == 0
