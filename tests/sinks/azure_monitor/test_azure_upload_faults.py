"""The sink's uploader against a loopback Logs Ingestion server, through the real LogsIngestionClient.

Each fault the service can serve gets its outcome: 429/5xx/hang/refused are retried (Retry-After
honoured, later chunks held back) and nothing is lost; 413 chunks are split; a row the service
rejects (400) is dead-lettered once while the rest of its batch goes through; a 400 for the request
itself (undeclared stream) and 403 keep the rows and say what to fix; spool I/O errors do not stop
the uploader.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time

import pytest

from gpumon.model import Event, MetricFamily, MetricSpec, MetricType, Severity, Snapshot
from gpumon.sinks.azure_monitor import AzureMonitorSink
from gpumon.sinks.base import SinkContext
from gpumon.sinks.spool import Spool
from tests.fakes import logs_ingestion
from tests.fakes.logs_ingestion import IngestionServer, UndeclaredStreamIs400
from tests.fakes.tokens import FakeCredential
from tests.support.declared_hints import hinted

EVENTS = "Custom-GpuMonEvents_CL"
GPU_STREAM = "Custom-GpuMonGpu_CL"
POWER = hinted(MetricSpec("gpumon_gpu_power_watts", MetricType.GAUGE, "p", "watts", ("gpu", "uuid")))


@pytest.fixture
def server(request, monkeypatch):
    if getattr(request, "param", None) == "undeclared-stream-400":
        monkeypatch.setattr(logs_ingestion, "_IngestHandler", UndeclaredStreamIs400)
    with IngestionServer() as srv:
        yield srv


@pytest.fixture
def make_sink(server, tmp_path):
    sinks: list[AzureMonitorSink] = []

    def make(credential=None, clock=time.monotonic, **options) -> AzureMonitorSink:
        cfg = {"endpoint": server.endpoint, "dcr_immutable_id": server.dcr_id, "ca_bundle": server.ca_path,
               "imds_url": "", "upload_interval": 60.0, "timeout": 2.0, **options}
        sink = AzureMonitorSink(SinkContext("node-1", str(tmp_path), "test"), cfg,
                                credential=credential or FakeCredential(), clock=clock)
        sink.backoff_min = sink.config_backoff_min = 0.1
        sink.start()
        sinks.append(sink)
        return sink

    yield make
    server.release_hung()
    for sink in sinks:
        sink.stop(2.0)


def events(n: int, message: str = "flap") -> tuple[Event, ...]:
    return tuple(Event("ib_link_flap", Severity.WARNING, {"device": f"mlx5_ib{i % 8}", "port": "1"},
                       f"{message} {i}", {"i": i}) for i in range(n))


def publish_events(sink: AzureMonitorSink, evs: tuple[Event, ...]) -> None:
    sink.publish(Snapshot("node-1", time.time(), (), evs, ()))


def wait_health(sink: AzureMonitorSink, predicate, timeout: float = 10.0):
    """Poll the sink's health with a deadline (it changes on the uploader thread)."""
    deadline = time.monotonic() + timeout
    while True:
        health = sink.health()
        if predicate(health):
            return health
        if time.monotonic() > deadline:
            raise AssertionError(f"health never matched: {health}")
        threading.Event().wait(0.02)


def delivered_ids(server: IngestionServer, stream: str = EVENTS) -> set[str]:
    return {r["RowId"] for r in server.rows(stream)}


def test_events_are_sent_promptly_not_at_the_interval(server, make_sink):
    sink = make_sink(upload_interval=3600.0)
    publish_events(sink, events(3))
    assert server.wait_for(lambda s: len(s.rows(EVENTS)) == 3, timeout=5)
    health = wait_health(sink, lambda h: h.extra["rows_queued"] == 0)
    assert health.exported == 3 and health.failed == 0 and health.extra["rows_queued"] == 0
    assert health.extra["last_success_timestamp_seconds"] > time.time() - 60


def test_interval_rows_are_schema_valid_and_one_per_gpu(server, make_sink):
    sink = make_sink(upload_interval=0.2)
    deadline = time.monotonic() + 5
    while not server.rows(GPU_STREAM) and time.monotonic() < deadline:
        fam = MetricFamily(POWER, (POWER.sample(300, "0", "GPU-a"), POWER.sample(310, "1", "GPU-b")))
        sink.publish(Snapshot("node-1", time.time(), (fam,), (), ()))
        server.wait_for(lambda s: bool(s.rows(GPU_STREAM)), timeout=0.05)
    rows = server.rows(GPU_STREAM)
    assert sorted(r["Gpu"] for r in rows[:2]) == [0, 1]
    assert all(req.status == 204 for req in server.requests())  # the server validated every row


def test_429_with_retry_after_is_honoured(server, make_sink):
    server.fail(429, retry_after=0.6)
    sink = make_sink()
    publish_events(sink, events(2))
    assert server.wait_for(lambda s: len(s.rows(EVENTS)) == 2, timeout=10)
    first, second = server.requests()[:2]
    assert (first.status, second.status) == (429, 204)
    assert len(server.requests()) == 2
    assert wait_health(sink, lambda h: h.exported == 2).failed == 1


def test_retry_after_delay_is_waited(server, make_sink):
    server.fail(429, retry_after=0.8)
    sink = make_sink()
    start = time.monotonic()
    publish_events(sink, events(1))
    assert server.wait_for(lambda s: len(s.rows(EVENTS)) == 1, timeout=10)
    assert time.monotonic() - start >= 0.75  # not retried before the service said it may be


@pytest.mark.parametrize("status", [500, 503])
def test_server_errors_are_retried_until_delivered(server, make_sink, status):
    server.fail(status, count=3)
    sink = make_sink()
    publish_events(sink, events(4))
    assert server.wait_for(lambda s: len(s.rows(EVENTS)) == 4, timeout=10)
    assert [r.status for r in server.requests()] == [status] * 3 + [204]
    assert wait_health(sink, lambda h: h.exported == 4).failed == 3


def test_hung_response_times_out_and_is_retried(server, make_sink):
    server.fail(0, hang=True)
    sink = make_sink(timeout=0.5)
    publish_events(sink, events(2))
    assert server.wait_for(lambda s: len(s.rows(EVENTS)) == 2, timeout=10)
    assert wait_health(sink, lambda h: h.exported == 2).failed >= 1


def test_connection_refused_then_back(server, make_sink):
    server.refuse()
    sink = make_sink()
    publish_events(sink, events(5))
    wait_health(sink, lambda h: "unreachable" in h.detail)
    assert sink.health().extra["rows_queued"] == 5 and sink.health().up is False
    server.resume()
    assert server.wait_for(lambda s: len(s.rows(EVENTS)) == 5, timeout=10)
    wait_health(sink, lambda h: h.up and h.extra["rows_queued"] == 0)


def test_413_chunk_is_split_and_everything_arrives(server, make_sink):
    server.fail(413)
    sink = make_sink()
    publish_events(sink, events(40))
    assert server.wait_for(lambda s: len(s.rows(EVENTS)) == 40, timeout=10)
    statuses = [r.status for r in server.requests()]
    assert statuses[0] == 413 and statuses[1:] == [204, 204]  # halves
    assert wait_health(sink, lambda h: h.exported == 40).dropped == 0


def test_single_row_too_large_is_dead_lettered(server, make_sink, tmp_path):
    server.fail(413, count=10)
    sink = make_sink()
    publish_events(sink, events(1))
    path = tmp_path / "spool" / "azure_monitor" / "deadletter.jsonl"
    wait_health(sink, lambda h: h.dropped == 1 and h.extra["rows_queued"] == 0)
    (line,) = path.read_text().splitlines()
    assert "HTTP 413" in json.loads(line)["reason"]
    assert sink.health().extra["rows_queued"] == 0  # not retried forever


def test_400_for_one_bad_row_dead_letters_it_and_delivers_the_rest(server, make_sink, tmp_path):
    server.reject_rows(lambda row: row.get("Message", "").startswith("poison"))
    sink = make_sink()
    evs = events(15) + events(1, message="poison") + events(15)
    publish_events(sink, evs)
    assert server.wait_for(lambda s: len(s.rows(EVENTS)) == 30, timeout=10)
    health = wait_health(sink, lambda h: h.extra["rows_queued"] == 0)
    assert health.dropped == 1 and health.exported == 30
    (line,) = (tmp_path / "spool" / "azure_monitor" / "deadletter.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert record["row"]["Message"] == "poison 0"
    assert "HTTP 400" in record["reason"] and "rejected" in record["reason"]
    assert len(delivered_ids(server)) == 30  # bisection sent no row twice


def test_403_keeps_rows_and_names_role_and_dcr(server, make_sink, caplog):
    server.forbid()
    sink = make_sink(client_id="11111111-2222-3333-4444-555555555555")
    publish_events(sink, events(3))
    detail = wait_health(sink, lambda h: "403" in h.detail).detail
    assert "Monitoring Metrics Publisher" in detail and server.dcr_id in detail
    assert "11111111-2222-3333-4444-555555555555" in detail
    assert server.wait_for(lambda s: len(s.requests()) >= 3)  # retried
    assert sink.health().extra["rows_queued"] == 3
    assert sum("403 forbidden" in r.getMessage() for r in caplog.records) == 1  # logged once, not per retry
    server.forbid(False)
    assert server.wait_for(lambda s: len(s.rows(EVENTS)) == 3, timeout=10)


def test_secret_is_never_logged(server, tmp_path, caplog):
    cfg = {"endpoint": server.endpoint, "dcr_immutable_id": server.dcr_id, "ca_bundle": server.ca_path,
           "imds_url": "", "credential": "service_principal", "tenant_id": "t", "client_id": "c",
           "client_secret": "s3cr3t-value"}
    sink = AzureMonitorSink(SinkContext("node-1", str(tmp_path), "test"), cfg)
    results = sink.check()  # the token request fails (no Entra ID here) and says so
    assert not results[0].ok
    text = " ".join(r.message for r in results) + " ".join(r.getMessage() for r in caplog.records)
    assert "s3cr3t-value" not in text and "s3cr3t-value" not in repr(sink.health())


def test_stop_flushes_the_partial_interval_within_the_timeout(server, make_sink):
    sink = make_sink(upload_interval=3600.0)
    fam = MetricFamily(POWER, (POWER.sample(300, "0", "GPU-a"),))
    sink.publish(Snapshot("node-1", time.time(), (fam,), (), ()))
    start = time.monotonic()
    sink.stop(3.0)
    assert time.monotonic() - start < 3.5
    assert len(server.rows(GPU_STREAM)) == 1


def test_publish_returns_at_once_while_the_endpoint_hangs(server, make_sink):
    server.fail(0, hang=True, count=100)
    sink = make_sink(timeout=30.0)  # an upload now blocks the uploader for 30 s
    publish_events(sink, events(1))
    assert server.wait_for(lambda s: s.hung_count() == 1, timeout=5)
    start = time.monotonic()
    for _ in range(50):
        publish_events(sink, events(2))
    assert time.monotonic() - start < 3.0  # 50 publishes, each appending to the spool, none waiting
    assert sink.health().extra["rows_queued"] == 101


def deadletter_lines(tmp_path) -> list[dict]:
    path = tmp_path / "spool" / "azure_monitor" / "deadletter.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("server", ["undeclared-stream-400"], indirect=True)
def test_400_for_an_undeclared_stream_keeps_the_rows_until_the_dcr_is_fixed(server, make_sink, tmp_path, caplog):
    declared = server.declarations.pop(EVENTS)  # a DCR that lacks the stream
    sink = make_sink()
    publish_events(sink, events(6))
    detail = wait_health(sink, lambda h: "400" in h.detail).detail
    assert EVENTS in detail and server.dcr_id in detail and "not declared" in detail
    assert server.wait_for(lambda s: len(s.requests()) >= 3)  # retried...
    health = sink.health()
    assert health.dropped == 0 and health.extra["rows_queued"] == 6 and not health.up  # ...not dead-lettered
    assert deadletter_lines(tmp_path) == []
    assert len({r.wire_bytes for r in server.requests()}) == 1  # always the whole batch: no bisection
    assert sum("not declared" in r.getMessage() for r in caplog.records) == 1  # logged once
    server.declarations[EVENTS] = declared  # the DCR is fixed
    assert server.wait_for(lambda s: len(s.rows(EVENTS)) == 6, timeout=10)
    assert wait_health(sink, lambda h: h.up and h.extra["rows_queued"] == 0).dropped == 0


def test_400_refusing_rows_alone_alike_is_a_request_fault_not_bad_rows(server, make_sink, tmp_path, caplog):
    server.fail(400, count=8, stream=EVENTS)  # the same error for the batch and for its rows sent alone
    sink = make_sink()
    publish_events(sink, events(5))
    assert server.wait_for(lambda s: len(s.rows(EVENTS)) == 5, timeout=10)
    # The batch, its first, middle and last rows alone: a request fault, kept; twice; then all of it.
    assert [r.status for r in server.requests()] == [400] * 8 + [204]
    health = wait_health(sink, lambda h: h.extra["rows_queued"] == 0)
    assert health.dropped == 0 and health.exported == 5 and health.up
    assert deadletter_lines(tmp_path) == []
    assert sum("refused the same way" in r.getMessage() for r in caplog.records) == 1


def test_bad_rows_at_both_ends_of_a_batch_do_not_hold_back_the_good_ones(server, make_sink, tmp_path):
    """Two rejected rows around good ones look like a request fault to the first/last probe alone:
    the middle row decides, the good rows go through and only the bad ones are dead-lettered."""
    server.reject_rows(lambda row: row.get("Message", "").startswith("poison"))
    sink = make_sink()
    publish_events(sink, events(1, "poison") + events(5) + events(1, "poison"))
    health = wait_health(sink, lambda h: h.extra["rows_queued"] == 0)
    assert len(server.rows(EVENTS)) == 5
    assert sorted(line["row"]["Message"] for line in deadletter_lines(tmp_path)) == ["poison 0", "poison 0"]
    assert health.exported == 5 and health.dropped == 2


def test_dead_lettered_row_is_not_sent_again_when_its_batch_is_retried(server, make_sink, tmp_path):
    server.reject_rows(lambda row: row.get("Message", "").startswith("poison"))
    server.fail(503, stream=GPU_STREAM)  # the batch's other stream fails once: the whole batch is retried
    now = [1000.0]
    sink = make_sink(clock=lambda: now[0])
    fam = MetricFamily(POWER, (POWER.sample(300, "0", "GPU-a"),))
    sink.publish(Snapshot("node-1", time.time(), (fam,), (), ()))  # opens the interval
    now[0] += 60.0  # the next publish spools its events and the GPU row together: one batch
    sink.publish(Snapshot("node-1", time.time(), (fam,), events(3) + events(1, "poison") + events(3), ()))
    assert server.wait_for(lambda s: len(s.rows(GPU_STREAM)) == 1, timeout=10)
    health = wait_health(sink, lambda h: h.extra["rows_queued"] == 0)
    assert [line["row"]["Message"] for line in deadletter_lines(tmp_path)] == ["poison 0"]
    assert health.dropped == 1 and health.exported == 7
    assert len(server.rows(EVENTS)) == 6 and len(delivered_ids(server)) == 6


def test_429_ends_the_batch_and_its_later_chunks_wait_for_retry_after(server, make_sink):
    server.fail(429, retry_after=1.0)
    sink = make_sink()
    big = tuple(Event("gpu_xid", Severity.ERROR, {"gpu": "0"}, f"{i:03d} " + "x" * 60000, {})
                for i in range(40))  # 2.4 MB: three chunks of at most 1 MiB
    publish_events(sink, big)
    assert server.wait_for(lambda s: len(s.requests()) == 1, timeout=5)
    assert not server.wait_for(lambda s: len(s.requests()) > 1, timeout=0.5)  # nothing more while throttled
    assert server.wait_for(lambda s: len(s.rows(EVENTS)) == 40, timeout=10)
    assert [r.status for r in server.requests()] == [429, 204, 204, 204]
    assert [r["Message"][:3] for r in server.rows(EVENTS)] == [f"{i:03d}" for i in range(40)]  # in order
    assert wait_health(sink, lambda h: h.exported == 40).failed == 1


def fail_first(monkeypatch, obj, name: str, code: int, times: int) -> list[int]:
    """Make ``obj.name`` raise OSError(code) on its first ``times`` calls: the disk fault, nothing else."""
    real = getattr(obj, name)
    left = [times]

    def flaky(*args, **kwargs):
        if left[0] > 0:
            left[0] -= 1
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, flaky)
    return left


def test_uploader_outlives_spool_sync_errors(server, make_sink, monkeypatch, caplog):
    sink = make_sink()
    left = fail_first(monkeypatch, sink._spool, "sync", errno.EIO, 3)
    publish_events(sink, events(4))
    assert server.wait_for(lambda s: len(s.rows(EVENTS)) == 4, timeout=10)
    assert left == [0]
    health = wait_health(sink, lambda h: h.up and h.extra["rows_queued"] == 0)
    assert health.failed == 3 and health.exported == 4
    assert sum(os.strerror(errno.EIO) in r.getMessage() for r in caplog.records) == 1  # logged once


def test_uploader_outlives_a_full_disk_when_acknowledging(server, make_sink, monkeypatch, tmp_path):
    sink = make_sink()
    left = fail_first(monkeypatch, sink._spool, "_persist_cursor", errno.ENOSPC, 2)
    for n in (3, 6, 9):
        publish_events(sink, events(3, message=f"batch-{n}"))
        assert server.wait_for(lambda s, n=n: len(s.rows(EVENTS)) == n, timeout=10)
    assert left == [0]
    health = wait_health(sink, lambda h: h.up and h.extra["rows_queued"] == 0)
    assert health.failed == 0 and health.exported == 9  # delivered: a position not saved is no failed upload
    assert len(delivered_ids(server)) == 9  # nothing sent twice
    sink.stop(2.0)
    assert Spool(str(tmp_path / "spool" / "azure_monitor"), 256 << 20).stats().records == 0


PLUGIN = MetricSpec("acme_rack_inlet_celsius", MetricType.GAUGE, "inlet", "celsius", ("rack",))
METRICS_STREAM = "Custom-GpuMonMetrics_CL"


@pytest.mark.parametrize("server", [None, "undeclared-stream-400"], indirect=True)
def test_a_dcr_without_the_generic_stream_turns_generic_rows_off_and_blocks_nothing(server, make_sink, caplog):
    """A DCR deployed before the generic metrics stream existed answers 404 (or 400) for it: the GPU
    rows of the same batch, and every later batch, still arrive; generic rows stop, logged once."""
    server.declarations.pop(METRICS_STREAM)
    sink = make_sink(upload_interval=0.2)

    def snapshot(value: float) -> Snapshot:
        power = MetricFamily(POWER, (POWER.sample(value, "0", "GPU-a"),))
        rack = MetricFamily(PLUGIN, (PLUGIN.sample(21.5, "r1"),))
        return Snapshot("node-1", time.time(), (power, rack), (), ())

    deadline = time.monotonic() + 10
    while len(server.rows(GPU_STREAM)) < 3 and time.monotonic() < deadline:
        sink.publish(snapshot(300 + len(server.rows(GPU_STREAM))))
        server.wait_for(lambda s: len(s.rows(GPU_STREAM)) >= 3, timeout=0.05)
    assert len(server.rows(GPU_STREAM)) >= 3, "GPU rows stopped behind the missing stream"
    assert server.rows(METRICS_STREAM) == []
    assert sum("for generic metric rows" in r.getMessage() for r in caplog.records) == 1
    assert not any("deadletter" in r.getMessage() for r in caplog.records)
    assert sink.health().up
