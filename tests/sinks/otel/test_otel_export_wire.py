"""What arrives at a real OTLP receiver (HTTP/protobuf and gRPC): names, units, temporality,
attributes, resource, values, start times; and events as log records."""

from __future__ import annotations

import time

import pytest
from opentelemetry.proto.metrics.v1 import metrics_pb2

from gpumon.model import Event, Severity, Snapshot
from gpumon.sinks import otel
from tests.fakes import otlp as receivers
from tests.support.otel import (
    POINTS,
    UUID,
    attrs,
    make_sink,
    snapshot,
)

# The receivers' fixtures, shared with this module.
grpc_receiver = receivers.grpc_receiver
http_receiver = receivers.http_receiver


def only(received, name):
    found = received.metric_points()[name]
    return found[-1][0]


@pytest.fixture(params=["http/protobuf", "grpc"])
def receiver(request):
    return request.getfixturevalue("http_receiver" if request.param == "http/protobuf" else "grpc_receiver")


@pytest.fixture
def protocol(receiver):
    return "grpc" if type(receiver).__name__ == "OtlpGrpcReceiver" else "http/protobuf"


def test_metrics_arrive_in_the_hardware_conventions(receiver, protocol, tmp_path):
    sink = make_sink(receiver.endpoint, tmp_path, protocol=protocol,
                     resource_attributes=["deployment.environment.name=test"])
    sink.start()
    try:
        t = time.time()
        sink.publish(snapshot(t, energy=1000.0, rx=4096.0))
        receiver.wait(lambda r: r.metrics)
    finally:
        sink.stop(5)
    request = receiver.metrics[0]
    resource = attrs(request.resource_metrics[0].resource)
    assert resource["service.name"] == "gpumon"
    assert resource["service.version"] == "9.9.9"
    assert resource["host.name"] == "node-7"
    assert resource["deployment.environment.name"] == "test"
    scope = request.resource_metrics[0].scope_metrics[0].scope
    assert (scope.name, scope.version) == ("gpumon", "9.9.9")

    util = only(receiver, "hw.gpu.utilization")
    assert util.unit == "1" and util.WhichOneof("data") == "gauge"
    tasks = {attrs(p)["hw.gpu.task"]: p.as_double for p in util.gauge.data_points}
    assert tasks == {"general": 0.75, "encoder": 0.25}
    point = util.gauge.data_points[0]
    assert point.time_unix_nano == int(t * 1e9)
    a = attrs(point)
    assert a["hw.id"] == UUID and a["hw.type"] == "gpu" and a["hw.name"] == "gpu0"
    assert a["hw.vendor"] == "NVIDIA" and a["hw.model"] == "NVIDIA H100 80GB HBM3"
    assert a["hw.driver_version"] == "550.54.15" and a["hw.firmware_version"] == "96.00.74.00.01"
    assert a["hw.serial_number"] == "1650123456789"

    mem = only(receiver, "hw.gpu.memory.usage")
    assert mem.unit == "By" and mem.WhichOneof("data") == "sum"
    assert not mem.sum.is_monotonic
    assert mem.sum.aggregation_temporality == metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE
    assert mem.sum.data_points[0].as_double == 2 ** 33

    energy = only(receiver, "hw.energy")
    assert energy.unit == "J" and energy.sum.is_monotonic
    assert energy.sum.aggregation_temporality == metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE
    ep = energy.sum.data_points[0]
    assert ep.as_double == 1000.0 and ep.start_time_unix_nano == ep.time_unix_nano  # unknown start

    temp = only(receiver, "hw.temperature")
    sensors = {attrs(p)["hw.sensor_location"]: attrs(p) for p in temp.gauge.data_points}
    assert temp.unit == "Cel" and set(sensors) == {"gpu", "memory"}
    assert sensors["memory"]["hw.type"] == "temperature" and sensors["memory"]["hw.parent"] == UUID
    assert sensors["memory"]["hw.id"] == f"{UUID}:temperature:memory"

    status = only(receiver, "hw.status")  # the lost-GPU gauge and the port's up, one point per hw.state
    states = {(attrs(p)["hw.type"], attrs(p)["hw.state"]): p.as_double for p in status.sum.data_points}
    assert states == {("gpu", "ok"): 1.0, ("gpu", "failed"): 0.0, ("network", "ok"): 1.0,
                      ("network", "failed"): 0.0}

    errors = only(receiver, "hw.errors")
    assert errors.unit == "{error}" and errors.sum.is_monotonic
    by_type = {attrs(p)["error.type"]: attrs(p) for p in errors.sum.data_points}
    assert set(by_type) == {"xid_79", "symbol"}
    assert by_type["xid_79"]["hw.type"] == "gpu" and by_type["symbol"]["hw.type"] == "network"

    clock = only(receiver, "gpumon.gpu.sm_clock")  # no convention: mechanical name, UCUM unit
    assert clock.unit == "Hz"  # and hw.id / hw.type, so that it joins the hw.* series of its GPU
    assert attrs(clock.gauge.data_points[0]) == {"gpu": "0", "uuid": UUID, "hw.id": UUID, "hw.type": "gpu"}

    io = only(receiver, "hw.network.io")
    assert io.unit == "By" and io.sum.is_monotonic
    by_direction = {attrs(p)["network.io.direction"]: p for p in io.sum.data_points}
    assert by_direction["receive"].as_double == 4096.0 and by_direction["transmit"].as_double == 2048.0
    na = attrs(by_direction["receive"])
    assert na["hw.id"] == "mlx5_ib0:1" and na["hw.type"] == "network"
    assert na["hw.model"] == "MT4129" and na["hw.firmware_version"] == "28.39.1002"

    up = only(receiver, "hw.network.up")
    assert up.unit == "1" and not up.sum.is_monotonic and up.sum.data_points[0].as_double == 1

    downed = only(receiver, "gpumon.ib.port_link_downed")  # no convention: mechanical
    assert downed.unit == "{event}" and downed.sum.is_monotonic
    assert attrs(downed.sum.data_points[0]) == {"device": "mlx5_ib0", "port": "1", "hw.id": "mlx5_ib0:1",
                                                "hw.type": "network"}

    info = only(receiver, "gpumon.gpu.info")
    assert info.WhichOneof("data") == "gauge" and attrs(info.gauge.data_points[0])["model"].startswith("NVIDIA")
    assert sink.health().exported == POINTS


def test_counter_start_time_is_stable_and_moves_on_reset(http_receiver, tmp_path):
    """The metrics data model's unknown-start convention: the first point of a series is a reset point
    (start == time), later points keep that start, and a counter that went down starts again at its
    own time. Never an earlier, made-up start that would claim the whole value for a short interval."""
    sink = make_sink(http_receiver.endpoint, tmp_path, logs=False)
    sink.start()
    try:
        t0 = time.time()
        for i, (energy, t) in enumerate([(1000.0, t0), (2000.0, t0 + 1), (5.0, t0 + 2), (7.0, t0 + 3)]):
            sink.publish(snapshot(t, energy=energy, rx=10.0 * (i + 1), seq=i + 1))
            http_receiver.wait(lambda r, n=i + 1: len(r.metrics) >= n)
    finally:
        sink.stop(5)
    points = [m.sum.data_points[0] for m, _ in http_receiver.metric_points()["hw.energy"]]
    assert [p.as_double for p in points] == [1000.0, 2000.0, 5.0, 7.0]
    times = [p.time_unix_nano for p in points]
    assert times == [int(t * 1e9) for t in (t0, t0 + 1, t0 + 2, t0 + 3)]
    assert [p.start_time_unix_nano for p in points] == [times[0], times[0], times[2], times[2]]

    # an up-down counter (memory in use) and a rising counter (bytes received) keep their first start
    for name in ("hw.gpu.memory.usage", "hw.network.io"):
        starts = {m.sum.data_points[0].start_time_unix_nano for m, _ in http_receiver.metric_points()[name]}
        assert starts == {times[0]}, name


def test_events_become_log_records_with_severity_and_attributes(receiver, protocol, tmp_path):
    flap = Event("ib_link_flap", Severity.WARNING, {"device": "mlx5_ib3", "port": "1"},
                 "mlx5_ib3 port 1 flapped", {"link_downed_delta": 1, "carrier_changes_delta": 2}, time=1700000000.5)
    xid = Event("gpu_xid", Severity.CRITICAL, {"gpu": "0", "uuid": UUID}, "GPU 0 reported XID 79",
                {"xid": 79, "description": "GPU has fallen off the bus"}, time=1700000001.25)
    sink = make_sink(receiver.endpoint, tmp_path, protocol=protocol)
    sink.start()
    try:
        sink.publish(snapshot(time.time(), 1.0, 1.0, events=(flap, xid)))
        receiver.wait(lambda r: len(r.log_records()) >= 2)
    finally:
        sink.stop(5)
    (rec_flap, rl), (rec_xid, _) = receiver.log_records()
    assert attrs(rl.resource)["service.name"] == "gpumon"
    assert receivers.event_name(rec_flap) == "gpumon.ib_link_flap"
    assert rec_flap.severity_number == 13 and rec_flap.severity_text == "WARNING"
    assert rec_flap.time_unix_nano == 1700000000500000000
    assert rec_flap.body.string_value == "mlx5_ib3 port 1 flapped"
    fa = attrs(rec_flap)
    assert fa["hw.id"] == "mlx5_ib3:1" and fa["hw.type"] == "network"
    assert fa["device"] == "mlx5_ib3" and fa["link_downed_delta"] == 1
    assert rec_xid.severity_number == 21 and rec_xid.severity_text == "CRITICAL"
    xa = attrs(rec_xid)
    assert xa["hw.id"] == UUID and xa["xid"] == 79 and xa["gpumon.event.kind"] == "gpu_xid"
    assert xa["event.name"] == "gpumon.gpu_xid" and fa["event.name"] == "gpumon.ib_link_flap"
    health = sink.health()
    assert health.extra["exported_log_records"] == 2 and health.extra["queued_records"] == 0


@pytest.mark.parametrize("with_event_name", [True, False], ids=["proto>=1.35", "proto<1.35"])
def test_log_records_without_the_event_name_field_still_carry_the_name(receiver, protocol, with_event_name,
                                                                       tmp_path):
    """opentelemetry-proto before 1.35 has no LogRecord.event_name and refuses it as a keyword; the
    records must still encode, arrive, and name their event (as the ``event.name`` attribute)."""
    assert receivers.LOG_RECORD_HAS_EVENT_NAME or not with_event_name, \
        "the test extra's opentelemetry-proto (1.35 or later) has LogRecord.event_name"
    flap = Event("ib_link_flap", Severity.WARNING, {"device": "mlx5_ib3", "port": "1"}, "flapped", time=1.5)
    request = otel.encode_logs([flap], {"service.name": "gpumon"}, "9.9.9", with_event_name=with_event_name)
    settings = otel.resolve_settings({"endpoint": receiver.endpoint, "protocol": protocol}, "logs", {})
    transport = otel.make_transport(settings, "9.9.9")
    try:
        result = otel.send(transport, request, 5)
    finally:
        transport.close()
    assert result.ok, result.detail
    [(record, _)] = receiver.log_records()
    if receivers.LOG_RECORD_HAS_EVENT_NAME:
        assert record.event_name == ("gpumon.ib_link_flap" if with_event_name else "")
    assert attrs(record)["event.name"] == "gpumon.ib_link_flap"
    assert attrs(record)["gpumon.event.kind"] == "ib_link_flap" and attrs(record)["hw.id"] == "mlx5_ib3:1"
    assert record.severity_number == 13 and record.body.string_value == "flapped"


def test_the_event_name_field_is_used_when_the_installed_classes_have_it():
    assert otel.log_record_has_event_name() is receivers.LOG_RECORD_HAS_EVENT_NAME
    flap = Event("ib_link_flap", Severity.WARNING, {"device": "mlx5_ib3", "port": "1"}, "flapped", time=1.5)
    record = otel.encode_logs([flap], {}, "9.9.9").resource_logs[0].scope_logs[0].log_records[0]
    assert attrs(record)["event.name"] == "gpumon.ib_link_flap"
    if receivers.LOG_RECORD_HAS_EVENT_NAME:
        assert record.event_name == "gpumon.ib_link_flap"


def test_gzip_and_headers_reach_the_collector(http_receiver, tmp_path):
    sink = make_sink(http_receiver.endpoint, tmp_path, logs=False, compression="gzip",
                     headers=["x-scope-orgid=tenant-a"],
                     environ={"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20abc,x-scope-orgid=env"})
    sink.start()
    try:
        sink.publish(snapshot(time.time(), 1.0, 1.0))
        http_receiver.wait(lambda r: r.metrics)
    finally:
        sink.stop(5)
    headers = http_receiver.headers[0]
    assert headers["content-encoding"] == "gzip"
    assert headers["authorization"] == "Bearer abc"
    assert headers["x-scope-orgid"] == "tenant-a"  # config wins over the environment
    assert headers["content-type"] == "application/x-protobuf"


def test_grpc_metadata_and_gzip(grpc_receiver, tmp_path):
    sink = make_sink(grpc_receiver.endpoint, tmp_path, protocol="grpc", logs=False, compression="gzip",
                     headers=["X-Tenant=a"])
    sink.start()
    try:
        sink.publish(snapshot(time.time(), 1.0, 1.0))
        grpc_receiver.wait(lambda r: r.metrics)
    finally:
        sink.stop(5)
    assert grpc_receiver.headers[0]["x-tenant"] == "a"


def test_republished_snapshot_without_new_collector_runs_is_not_exported_again(http_receiver, tmp_path):
    """The loop re-publishes several times a second; only a new collector run means new data."""
    sink = make_sink(http_receiver.endpoint, tmp_path, logs=False)
    sink.start()
    try:
        first = snapshot(time.time(), 1.0, 1.0)
        sink.publish(first)
        http_receiver.wait(lambda r: len(r.metrics) == 1)
        for i in range(5):  # same collector statuses, new Snapshot objects
            sink.publish(Snapshot(first.host, first.time + i, first.families, (), first.collectors, 10 + i))
        fresh = snapshot(time.time() + 10, 2.0, 2.0, seq=99)
        sink.publish(fresh)
        http_receiver.wait(lambda r: len(r.metrics) == 2)
    finally:
        sink.stop(5)
    assert len(http_receiver.metrics) == 2
    assert http_receiver.attempts == 2


def test_fixed_interval_coalesces_to_the_latest_snapshot(http_receiver, tmp_path):
    sink = make_sink(http_receiver.endpoint, tmp_path, logs=False, interval=0.3)
    sink.start()
    try:
        snap = snapshot(time.time(), 1.0, 1.0)
        for i in range(3):  # within one interval: only the last is sent
            sink.publish(Snapshot(snap.host, snap.time + i, snap.families, (), snap.collectors, i))
        http_receiver.wait(lambda r: len(r.metrics) == 1)
        sink.publish(Snapshot(snap.host, snap.time + 10, snap.families, (), snap.collectors, 10))
        http_receiver.wait(lambda r: len(r.metrics) == 2)
    finally:
        sink.stop(5)
    times = [only_point_time(m) for m in http_receiver.metrics]
    assert times == [int((snap.time + 2) * 1e9), int((snap.time + 10) * 1e9)]
    assert http_receiver.times[1] - http_receiver.times[0] >= 0.25


def only_point_time(request) -> int:
    return request.resource_metrics[0].scope_metrics[0].metrics[0].gauge.data_points[0].time_unix_nano


def test_stop_sends_the_snapshot_an_interval_still_holds_back(http_receiver, tmp_path):
    """At stop the newest snapshot goes out at once, within the stop's deadline, whatever the interval."""
    sink = make_sink(http_receiver.endpoint, tmp_path, logs=False, interval=60)
    sink.start()
    snap = snapshot(time.time(), 1.0, 1.0)
    sink.publish(snap)
    started = time.monotonic()
    sink.stop(5)
    assert time.monotonic() - started < 3
    assert [only_point_time(m) for m in http_receiver.metrics] == [int(snap.time * 1e9)]
    assert sink.health().extra["exported_data_points"] == POINTS
