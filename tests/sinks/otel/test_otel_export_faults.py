"""A collector that is down, slow, or answers 503 costs the daemon nothing: publish() stays instant,
exports are retried with backoff and counted, and stop() keeps its deadline."""

from __future__ import annotations

import contextlib
import ssl
import time

import pytest

from gpumon.model import Event, Severity
from gpumon.sinks import otel
from gpumon.sinks.otel.transport import grpc_retry_delay
from tests.conftest import closed_port, wait_for
from tests.fakes import otlp as receivers
from tests.support.otel import POINTS, make_sink, snapshot

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
    sink = make_sink(f"http://127.0.0.1:{closed_port()}", tmp_path, max_queued_records=5)
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
        assert sink.health().dropped == POINTS
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
        wait_for(lambda: sink.health().exported == POINTS, timeout=10)
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


# ------------------------------------------------------------------ the log queue while a batch is out


@contextlib.contextmanager
def running_split_sink(logs_receiver, metrics_receiver, tmp_path, **options):
    """A started ``split_sink``; the sink stopped and both receivers closed however the test ends."""
    sink = split_sink(logs_receiver, metrics_receiver, tmp_path, **options)
    sink.start()
    try:
        yield sink
    finally:
        sink.stop(2)
        logs_receiver.close()
        metrics_receiver.close()


def split_sink(logs_receiver, metrics_receiver, tmp_path, protocol: str = "http/protobuf", **options):
    """A sink whose logs go to one receiver and metrics to another, so that a test can hold or refuse
    one signal without the other's requests taking its answers."""
    suffix = ("/v1/logs", "/v1/metrics") if protocol == "http/protobuf" else ("", "")
    environ = {"OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": logs_receiver.endpoint + suffix[0],
               "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": metrics_receiver.endpoint + suffix[1]}
    return make_sink("", tmp_path, environ=environ, protocol=protocol, **options)


@pytest.mark.parametrize("answer, more, delivered, dropped", [
    (200, 2, [0, 1, 2, 3, 4], 0),  # two of the batch evicted: only the third may leave the queue
    (200, 5, [0, 1, 2, 5, 6, 7], 2),  # the whole batch and two never sent evicted: those two dropped
    (503, 2, [2, 3, 4], 2),  # the batch fails after two of it were evicted: those two are lost
], ids=["partly-evicted", "evicted-and-overflowed", "evicted-then-failed"])
def test_a_full_queue_during_a_slow_send_loses_only_what_it_counts(answer, more, delivered, dropped,
                                                                   tmp_path):
    """Events published while a batch is being sent push the oldest out of a full queue, the batch's
    own included; what the send's outcome removes is that batch, by sequence number, never the newer
    events that took its places."""
    logs, metrics = receivers.OtlpHttpReceiver(), receivers.OtlpHttpReceiver()
    logs.delay = 30  # each logs request waits for release
    logs.answers = [answer]
    with running_split_sink(logs, metrics, tmp_path, max_queued_records=3) as sink:
        sink.publish(snapshot(time.time(), 1.0, 1.0, events=tuple(event(i) for i in range(3)), seq=1))
        logs.wait(lambda r: r.attempts == 1)  # events 0-2 are out, the receiver holds them
        sink.publish(snapshot(time.time(), 2.0, 2.0, events=tuple(event(3 + i) for i in range(more)), seq=2))
        assert sink.health().extra["queued_records"] == 3
        logs.release.set()
        logs.wait(lambda r: len(r.log_records()) >= len(delivered))
        wait_for(lambda: sink.health().extra["queued_records"] == 0, timeout=10)
        health = sink.health()
    assert [record.body.string_value for record, _ in logs.log_records()] == [f"flap {i}" for i in delivered]
    assert health.extra["exported_log_records"] == len(delivered)
    assert health.dropped == dropped
    assert health.extra["exported_log_records"] + health.dropped == 3 + more  # every event accounted for


# --------------------------------------------------------------- gRPC RESOURCE_EXHAUSTED and RetryInfo


def test_grpc_resource_exhausted_with_retry_info_waits_the_servers_delay(grpc_receiver, tmp_path):
    grpc_receiver.answers = [429]  # RESOURCE_EXHAUSTED
    grpc_receiver.retry_after = "0.6"  # as RetryInfo.retry_delay in grpc-status-details-bin
    sink = make_sink(grpc_receiver.endpoint, tmp_path, protocol="grpc", logs=False,
                     backoff_initial=0.01, backoff_max=5)
    sink.start()
    try:
        sink.publish(snapshot(time.time(), 1.0, 1.0))
        grpc_receiver.wait(lambda r: r.metrics)
        wait_for(lambda: sink.health().exported == POINTS, timeout=10)
        health = sink.health()
    finally:
        sink.stop(2)
    assert grpc_receiver.attempt_times[1] - grpc_receiver.attempt_times[0] >= 0.55
    assert health.failed == 1 and health.dropped == 0 and health.up


def test_grpc_resource_exhausted_without_retry_info_drops_that_metrics_export(grpc_receiver, tmp_path):
    """The OTLP specification: RESOURCE_EXHAUSTED is retryable only with RetryInfo. The counters are
    cumulative, so the next snapshot carries what the dropped one had."""
    grpc_receiver.answers = [429]
    sink = make_sink(grpc_receiver.endpoint, tmp_path, protocol="grpc", logs=False)
    sink.start()
    try:
        sink.publish(snapshot(time.time(), 1.0, 1.0, seq=1))
        wait_for(lambda: sink.health().failed == 1, timeout=10)
        assert sink.health().dropped == POINTS
        assert "RESOURCE_EXHAUSTED" in sink.health().detail
        sink.publish(snapshot(time.time(), 2.0, 2.0, seq=2))
        grpc_receiver.wait(lambda r: r.metrics)
    finally:
        sink.stop(2)
    assert grpc_receiver.attempts == 2  # the refused snapshot was not sent again
    assert grpc_receiver.metric_points()["hw.energy"][0][0].sum.data_points[0].as_double == 2.0


@pytest.mark.parametrize("refusals", [otel.THROTTLED_LOG_ATTEMPTS - 1, otel.THROTTLED_LOG_ATTEMPTS])
def test_grpc_resource_exhausted_without_retry_info_gives_events_a_few_attempts(refusals, tmp_path):
    """An event is not carried by the next export the way a counter is, so a log batch refused without
    RetryInfo gets THROTTLED_LOG_ATTEMPTS tries with backoff; after that it is dropped (counted), so a
    batch that can never pass does not hold the events behind it."""
    logs, metrics = receivers.OtlpGrpcReceiver(), receivers.OtlpGrpcReceiver()
    logs.answers = [429] * refusals
    with running_split_sink(logs, metrics, tmp_path, protocol="grpc") as sink:
        sink.publish(snapshot(time.time(), 1.0, 1.0, events=(event(0),), seq=1))
        wait_for(lambda: logs.attempts == refusals and sink.health().extra["queued_records"] <= 1, timeout=10)
        sink.publish(snapshot(time.time(), 2.0, 2.0, events=(event(1),), seq=2))
        logs.wait(lambda r: any(rec.body.string_value == "flap 1" for rec, _ in r.log_records()))
        wait_for(lambda: sink.health().extra["queued_records"] == 0, timeout=10)
        health = sink.health()
    given_up = refusals >= otel.THROTTLED_LOG_ATTEMPTS
    bodies = [record.body.string_value for record, _ in logs.log_records()]
    assert bodies == (["flap 1"] if given_up else ["flap 0", "flap 1"])
    assert health.dropped == (1 if given_up else 0)
    assert health.extra["exported_log_records"] == (1 if given_up else 2)
    assert health.failed == refusals


def test_retry_info_is_read_from_the_status_details():
    import grpc

    details = receivers.retry_info_status(grpc.StatusCode.RESOURCE_EXHAUSTED, 2.25)
    assert grpc_retry_delay([("grpc-status-details-bin", details)]) == 2.25
    assert grpc_retry_delay([("grpc-status-details-bin", b"\xff\x00 not a status")]) is None
    assert grpc_retry_delay([("retry-after", "3")]) == 3.0
    assert grpc_retry_delay([]) is None


# ------------------------------------------------------------------- a transport that cannot be built


def test_a_certificate_that_is_not_there_fails_start_not_the_export_threads(tmp_path):
    """The OTEL_* variables name files no config check has seen: start() says which and why."""
    missing = str(tmp_path / "absent-ca.pem")
    sink = make_sink("https://127.0.0.1:4318", tmp_path, environ={"OTEL_EXPORTER_OTLP_CERTIFICATE": missing})
    with pytest.raises(RuntimeError) as err:
        sink.start()
    assert "certificate" in str(err.value) and missing in str(err.value)
    assert not sink._uploaders


def test_a_certificate_that_is_not_pem_fails_start_naming_the_file(tmp_path):
    garbage = tmp_path / "ca.pem"
    garbage.write_text("not a certificate\n")
    sink = make_sink("https://127.0.0.1:4318", tmp_path, certificate=str(garbage))
    with pytest.raises(RuntimeError) as err:
        sink.start()
    assert str(garbage) in str(err.value) and "metrics" in str(err.value)


def test_a_transport_fault_is_a_retried_attempt_not_a_dead_thread(http_receiver, tmp_path, monkeypatch):
    real = otel.export.send
    faults = {"left": 2}

    def flaky(transport, message, timeout=None):
        if faults["left"]:
            faults["left"] -= 1
            raise ssl.SSLError("certificate verify failed: unable to get local issuer certificate")
        return real(transport, message, timeout)

    monkeypatch.setattr(otel.export, "send", flaky)
    sink = make_sink(http_receiver.endpoint, tmp_path, logs=False)
    sink.start()
    try:
        sink.publish(snapshot(time.time(), 1.0, 1.0))
        wait_for(lambda: sink.health().failed >= 1, timeout=10)
        assert "certificate verify failed" in sink.health().detail
        http_receiver.wait(lambda r: r.metrics)
        wait_for(lambda: sink.health().up, timeout=10)
        assert sink.health().failed == 2
        assert all(u.running for u in sink._uploaders)
    finally:
        sink.stop(2)
