"""The remote_write sink against a loopback receiver: the wire (headers, labels, timestamps, staleness),
and each fault (down, hung, 5xx, 429 with Retry-After, 400 for out-of-order samples, 413, 401, a
restart of gpumon) handled, counted and logged once, without the loop ever waiting."""

from __future__ import annotations

import dataclasses
import logging
import math
import struct
import time

import pytest

from gpumon.model import CollectorStatus
from tests.conftest import closed_port, wait_for
from tests.fakes.remote_write import Receiver, Reply, delivered, make_sink, small_snapshot

T0 = 1_760_000_000.123


@pytest.fixture
def receiver():
    server = Receiver()
    yield server
    server.close()


@pytest.fixture
def started(tmp_path):
    sinks = []

    def start(url: str, **options):
        sink = make_sink(tmp_path, url, **options)
        sink.start()
        sinks.append(sink)
        return sink

    yield start
    for sink in sinks:
        sink.stop(1.0)


def test_request_headers_labels_and_timestamps(receiver, started):
    sink = started(receiver.url, external_labels=["cluster=eastus-a", "gpu=shadowed"])
    sink.publish(small_snapshot(T0))
    wait_for(lambda: delivered(sink))
    request = receiver.received[0]
    assert request.headers["Content-Encoding"] == "snappy"
    assert request.headers["Content-Type"] == "application/x-protobuf"
    assert request.headers["X-Prometheus-Remote-Write-Version"] == "0.1.0"
    assert request.headers["User-Agent"].startswith("gpumon/")
    series = {dict(labels)["__name__"] + dict(labels).get("gpu", ""): (labels, samples)
              for labels, samples in request.series}
    labels, samples = series["gpumon_gpu_temperature_celsius1"]
    assert labels == [("__name__", "gpumon_gpu_temperature_celsius"), ("cluster", "eastus-a"), ("gpu", "1"),
                      ("instance", "nd-node"), ("job", "gpumon"), ("uuid", "GPU-1")]
    assert samples == [(41.0, 1_760_000_000_123)]
    # An external label fills in where the series has none of that name.
    assert series["gpumon_ib_port_transmit_bytes_totalshadowed"][1] == [(2.5e12, 1_760_000_000_123)]
    info_labels = dict(series["gpumon_gpu_info0"][0])
    assert "serial" not in info_labels and info_labels["model"] == "NVIDIA H100 80GB HBM3"
    assert series["gpumon_gpu_info0"][1][0][0] == 1.0
    for labels, _ in request.series:  # sorted by name, unique: what receivers require
        names = [name for name, _ in labels]
        assert names == sorted(set(names))


def test_a_series_that_disappears_gets_a_staleness_marker(receiver, started):
    sink = started(receiver.url)
    sink.publish(small_snapshot(T0, gpus=2))
    sink.publish(small_snapshot(T0 + 1, gpus=1))
    wait_for(lambda: len(receiver.received) == 2 and delivered(sink))
    last = {dict(labels).get("gpu"): samples for labels, samples in receiver.received[1].series
            if dict(labels)["__name__"] == "gpumon_gpu_temperature_celsius"}
    (value, stamp), = last["1"]
    assert math.isnan(value) and struct.pack("<d", value) == struct.pack("<Q", 0x7FF0000000000002)
    assert stamp == 1_760_000_001_123 and last["0"] == [(40.0, 1_760_000_001_123)]


def test_interval_sends_at_most_one_snapshot_per_period(receiver, started):
    sink = started(receiver.url, interval=3600.0)
    sink.publish(small_snapshot(T0))
    sink.publish(small_snapshot(T0 + 1))
    wait_for(lambda: delivered(sink))
    assert len(receiver.received) == 1


def test_a_republication_without_a_new_collector_run_is_not_sent(receiver, started):
    status = CollectorStatus("nvml", True, 0.01)
    first = dataclasses.replace(small_snapshot(T0), collectors=(status,))
    sink = started(receiver.url)
    sink.publish(first)
    sink.publish(dataclasses.replace(first, time=T0 + 0.25))  # the loop refreshing sink health
    sink.publish(dataclasses.replace(first, time=T0 + 1, collectors=(CollectorStatus("nvml", True, 0.02),)))
    wait_for(lambda: len(receiver.received) == 2 and delivered(sink))
    stamps = [r.series[0][1][0][1] for r in receiver.received]
    assert stamps == [1_760_000_000_123, 1_760_000_001_123]


def test_5xx_and_429_are_retried_honouring_retry_after(receiver, started):
    receiver.answer(Reply(503), Reply(429, retry_after="1"))
    sink = started(receiver.url, backoff_max=5.0)
    sink.publish(small_snapshot(T0))
    wait_for(lambda: delivered(sink), timeout=10)
    assert receiver.refused == [503, 429] and len(receiver.received) == 1
    assert receiver.times[2] - receiver.times[1] >= 0.95  # Retry-After: 1, not the 50 ms backoff
    health = sink.health()
    assert health.failed == 2 * 4 and health.exported == 4 and health.dropped == 0 and health.up


def test_400_out_of_order_is_dropped_counted_logged_once_and_not_retried(receiver, started, caplog):
    receiver.answer(Reply(400, body="out of order sample"), Reply(400, body="out of order sample"))
    sink = started(receiver.url)
    with caplog.at_level(logging.WARNING, logger="gpumon.sinks.remote_write"):
        for i in range(3):
            sink.publish(small_snapshot(T0 + i))
        wait_for(lambda: len(receiver.received) == 1 and delivered(sink))
    assert receiver.refused == [400, 400] and len(receiver.times) == 3  # each sent once
    assert sink.health().dropped == 8 and sink.health().exported == 4
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1 and "out of order sample" in lines[0]


def test_413_splits_the_request_until_it_goes(receiver, started):
    receiver.answer(Reply(413), Reply(413))
    sink = started(receiver.url)
    sink.publish(small_snapshot(T0, gpus=6))
    wait_for(lambda: delivered(sink))
    # 8 series: 413, split at once; the first half of 4: 413 again, so after a backoff every part at
    # least as large as that half is split before it is sent
    assert receiver.refused == [413, 413]
    assert all(size < receiver.sizes[1] for size in receiver.sizes[2:])
    assert receiver.samples() == 8 and sink.health().dropped == 0 and sink.health().up


def test_413_split_whose_second_half_fails_resends_only_that_half(receiver, started):
    receiver.answer(Reply(413), Reply(204), Reply(503))
    sink = started(receiver.url)
    sink.publish(small_snapshot(T0, gpus=6))
    wait_for(lambda: delivered(sink) and receiver.samples() >= 8)
    # 8 series: 413; the first half of 4 goes, the second gets 503 and is retried alone
    assert receiver.refused == [413, 503] and [len(r.series) for r in receiver.received] == [4, 4]
    names = [sorted(str(labels) for labels, _ in r.series) for r in receiver.received]
    assert not set(names[0]) & set(names[1])  # no series sent twice
    health = sink.health()
    assert receiver.samples() == 8 and health.exported == 8 and health.dropped == 0
    assert health.extra["requests_queued"] == 0


def test_413_for_a_single_series_drops_it_counted_once(receiver, started, caplog):
    receiver.max_body = 130  # the counter series alone is 137 bytes, the info series 127
    sink = started(receiver.url)
    with caplog.at_level(logging.WARNING, logger="gpumon.sinks.remote_write"):
        sink.publish(small_snapshot(T0, gpus=0))  # 2 series: 413, split at once; the counter is refused alone
        wait_for(lambda: sink.health().extra["requests_queued"] == 0 and receiver.samples() == 1)
    assert sink.health().dropped == 1
    assert len([r for r in caplog.records if "single series" in r.getMessage()]) == 1
    assert [dict(labels)["__name__"] for labels, _ in receiver.received[0].series] == ["gpumon_gpu_info"]


def test_a_receiver_answering_413_to_everything_gets_a_bounded_rate_of_requests(receiver, started, caplog):
    """A proxy refusing every body: splitting each refusal down to single series sent 2 x series - 1
    requests per snapshot at full speed. Each 413 after the first backs off, and a size refused is
    remembered, so the requests are a few per outage, and every sample is counted dropped once."""
    receiver.default = Reply(413, body="request entity too large")
    sink = started(receiver.url, backoff_initial=0.05, backoff_max=0.2)
    with caplog.at_level(logging.WARNING, logger="gpumon.sinks.remote_write"):
        for i in range(5):
            sink.publish(small_snapshot(T0 + i, gpus=60))  # 62 series each
        wait_for(lambda: sink.health().extra["requests_queued"] == 0 and sink.health().dropped == 5 * 62,
                 timeout=15)
    health = sink.health()
    assert len(receiver.times) <= 20, len(receiver.times)  # 5 x 123 before
    gaps = [b - a for a, b in zip(receiver.times[1:], receiver.times[2:], strict=False)]
    assert all(gap >= 0.02 for gap in gaps), gaps  # after the first split, never back to back
    assert receiver.samples() == 0 and not health.up
    assert len([r for r in caplog.records if "single series" in r.getMessage()]) == 1


def test_a_body_limit_once_learnt_is_not_hit_again(receiver, started):
    """A proxy with a body limit: once a 413 taught it, later snapshots are split before they are
    sent and none is refused again; nothing is lost."""
    receiver.max_body = 400
    sink = started(receiver.url)
    sink.publish(small_snapshot(T0, gpus=40))
    wait_for(lambda: delivered(sink) and receiver.samples() == 42)
    refused = len(receiver.refused)
    assert refused >= 1
    for i in range(1, 4):
        sink.publish(small_snapshot(T0 + i, gpus=40))
    wait_for(lambda: receiver.samples() == 4 * 42 and delivered(sink))
    assert len(receiver.refused) == refused
    assert sink.health().dropped == 0 and sink.health().up


def test_a_hung_receiver_hits_the_deadline_and_the_loop_never_waits(receiver, started, caplog):
    receiver.answer(Reply(200, hang=True))
    sink = started(receiver.url, timeout=0.5)
    with caplog.at_level(logging.WARNING, logger="gpumon.sinks.remote_write"):
        t = time.monotonic()
        sink.publish(small_snapshot(T0))
        wait_for(lambda: len(receiver.times) == 1)
        sink.publish(small_snapshot(T0 + 1))
        assert time.monotonic() - t < 0.5
        wait_for(lambda: delivered(sink) and receiver.samples() == 8, timeout=10)
    assert sink.health().failed == 4
    assert any("no answer within 0.5 s" in r.getMessage() for r in caplog.records)


def test_a_down_receiver_keeps_the_records_and_stop_is_bounded(tmp_path, started):
    sink = started(f"http://127.0.0.1:{closed_port()}/api/v1/write")
    t = time.monotonic()
    for i in range(5):
        sink.publish(small_snapshot(T0 + i))
    assert time.monotonic() - t < 0.5
    wait_for(lambda: sink.health().failed > 0)
    health = sink.health()
    assert not health.up and "ConnectionRefusedError" in health.detail and health.extra["requests_queued"] >= 1
    t = time.monotonic()
    sink.stop(1.0)
    assert time.monotonic() - t < 2.0


def test_records_spooled_before_a_restart_of_gpumon_are_sent_after_it(tmp_path, receiver):
    down = make_sink(tmp_path, f"http://127.0.0.1:{closed_port()}/api/v1/write")
    down.start()
    for i in range(3):
        down.publish(small_snapshot(T0 + i))
    down.stop(0.5)
    again = make_sink(tmp_path, receiver.url)
    again.start()
    try:
        wait_for(lambda: delivered(again))
    finally:
        again.stop(1.0)
    stamps = sorted({s[0][1] for r in receiver.received for _, s in r.series})
    assert stamps == [1_760_000_000_123, 1_760_000_001_123, 1_760_000_002_123]


def test_401_is_a_configuration_fault_kept_and_retried(started, caplog):
    server = Receiver(token="Bearer right")
    try:
        sink = started(server.url)
        with caplog.at_level(logging.WARNING, logger="gpumon.sinks.remote_write"):
            sink.publish(small_snapshot(T0))
            wait_for(lambda: len(server.times) >= 3)
        assert sink.health().dropped == 0 and sink.health().extra["requests_queued"] == 1
        assert len([r for r in caplog.records if "HTTP 401" in r.getMessage()]) == 1
        server.token = None
        wait_for(lambda: delivered(sink))
        assert server.samples() == 4
    finally:
        server.close()


def test_check_posts_an_empty_request_and_says_what_is_wrong(receiver, tmp_path):
    ok = make_sink(tmp_path, receiver.url).check()
    assert [r.ok for r in ok] == [True] and "accepts remote write" in ok[0].message
    assert receiver.received[0].series == [] and receiver.received[0].headers["Content-Encoding"] == "snappy"
    receiver.answer(Reply(404, body="not found"))
    refused = make_sink(tmp_path, receiver.url).check()
    assert not refused[0].ok and "HTTP 404: not found" in refused[0].message
    down = make_sink(tmp_path, f"http://127.0.0.1:{closed_port()}/api/v1/write").check()
    assert not down[0].ok and "unreachable" in down[0].message
    bad = make_sink(tmp_path, "ftp://127.0.0.1/x").check()
    assert not bad[0].ok and "url" in bad[0].message


# ----------------------------------------------------------------- redirects, 1xx, a receiver refusing


def test_a_307_to_the_same_origin_is_followed_within_the_deadline(receiver, started):
    receiver.answer(Reply(307, location="/api/v1/moved"), Reply(308, location=receiver.url.replace(
        "/api/v1/write", "/api/v1/final")))
    sink = started(receiver.url, auth="basic", username="gpumon", password="s3cret-pw")
    sink.publish(small_snapshot(T0))
    wait_for(lambda: delivered(sink))
    assert receiver.paths == ["/api/v1/write", "/api/v1/moved", "/api/v1/final"]
    assert receiver.received[0].headers["Authorization"].startswith("Basic ")
    health = sink.health()
    assert receiver.samples() == 4 and health.dropped == 0 and health.up


@pytest.mark.parametrize("status", [301, 302, 303, 307])
def test_a_redirect_elsewhere_is_a_configuration_fault_kept_and_retried_slowly(status, receiver, started, caplog):
    elsewhere = Receiver()
    try:
        receiver.answer(Reply(status, location=elsewhere.url), Reply(status, location=elsewhere.url))
        sink = started(receiver.url, auth="basic", username="gpumon", password="s3cret-pw")
        with caplog.at_level(logging.WARNING, logger="gpumon.sinks.remote_write"):
            sink.publish(small_snapshot(T0))
            wait_for(lambda: sink.health().failed > 0)
            health = sink.health()
            assert not health.up and health.dropped == 0 and health.extra["requests_queued"] == 1
            assert f"HTTP {status}" in health.detail
            wait_for(lambda: delivered(sink))  # after the two refusals, the receiver takes it
        assert elsewhere.times == []  # nothing, credentials least of all, went to the other origin
        assert receiver.times[1] - receiver.times[0] >= 0.1  # retried slowly (config_backoff_min 0.2)
        assert receiver.samples() == 4 and sink.health().dropped == 0 and sink.health().up
        lines = [r.getMessage() for r in caplog.records if f"HTTP {status}" in r.getMessage()]
        assert len(lines) == 1 and "check the configuration" in lines[0]
    finally:
        elsewhere.close()


def test_a_trickling_or_hung_redirect_target_is_cut_at_the_one_deadline(receiver, started):
    receiver.answer(Reply(307, location="/api/v1/slow"), Reply(200, hang=True))
    sink = started(receiver.url, timeout=0.5)
    started_at = time.monotonic()
    sink.publish(small_snapshot(T0))
    wait_for(lambda: sink.health().failed > 0, timeout=5)
    assert time.monotonic() - started_at < 1.2
    assert "no answer within 0.5 s" in sink.health().detail


def test_a_1xx_final_answer_is_retried_not_dropped(receiver, started):
    receiver.answer(Reply(199), Reply(102))
    sink = started(receiver.url)
    sink.publish(small_snapshot(T0))
    wait_for(lambda: delivered(sink) and receiver.samples() == 4)
    health = sink.health()
    assert health.dropped == 0 and health.failed == 2 * 4 and health.up


def test_the_sink_is_down_while_every_request_is_refused_and_up_again_after(receiver, started):
    """A clock step: every request answered 400 out of order. Each is dropped (the same request would
    fail again) but the sink says it is down, not up with everything lost."""
    receiver.default = Reply(400, body="out of order sample")
    sink = started(receiver.url)
    for i in range(3):
        sink.publish(small_snapshot(T0 + i))
    wait_for(lambda: sink.health().dropped == 12)
    health = sink.health()
    assert not health.up and "out of order" in health.detail
    receiver.default = Reply(204)
    sink.publish(small_snapshot(T0 + 3))
    wait_for(lambda: delivered(sink))
    assert sink.health().up


# ----------------------------------------------------------------------- dropped samples, exactly


def test_samples_the_full_spool_drops_are_counted_exactly_and_never_go_down(receiver, started):
    """The spool drops whole requests of different sizes: the count is what they held, taken when each
    is dropped (an estimate from a mean request size went down as the mean did)."""
    receiver.default = Reply(503)
    sink = started(receiver.url, spool_max_bytes=65536, backoff_initial=0.2, backoff_max=0.5)
    published, seen = 0, [0]
    for i in range(400):
        sink.publish(small_snapshot(T0 + i, gpus=200 if i < 60 else 1))
        published += sink._encoded_samples
        seen.append(sink.health().dropped)
    assert seen == sorted(seen) and seen[-1] > 0  # monotonic, and the spool did drop
    receiver.default = Reply(204)
    wait_for(lambda: sink.health().extra["requests_queued"] == 0, timeout=15)
    health = sink.health()
    assert health.dropped >= seen[-1]
    assert health.exported + health.dropped == published  # every sample delivered or counted once


def test_a_request_in_flight_when_the_spool_drops_it_is_counted_once(tmp_path):
    """The full spool drops the segment of the request being sent: delivered, it is exported and not
    also dropped; not delivered, it is dropped once, when the uploader reads on."""
    from gpumon.sinks.remote_write.sink import _record_samples
    from gpumon.sinks.spool import Spool

    spool = Spool(str(tmp_path / "spool"), 65536, weigh=_record_samples)
    record = struct.pack(">I", 7) + b"x" * 2000  # a request of 7 samples
    spool.append([record])
    for delivered_it in (True, False):
        before = spool.stats()
        batch = spool.read(max_records=1)
        assert batch is not None
        while any(seg.number == batch.segment for seg in spool._segments):
            spool.append([record])  # past the cap: the oldest segment, the batch's, is dropped
        after = spool.stats()
        lost = after.dropped - before.dropped  # records, the one in flight included
        assert lost > 1 and after.dropped_weight - before.dropped_weight == 7 * (lost - 1)
        if delivered_it:
            spool.ack(batch)  # stale (its segment is gone), but it was delivered: not dropped
        assert spool.read(max_records=1) is not None
        assert spool.stats().dropped_weight == after.dropped_weight + (0 if delivered_it else 7)
    spool.close()
