"""The otel sink's ``check()`` probe against real OTLP receivers on loopback (tests/fakes/otlp.py)."""

from __future__ import annotations

from tests.fakes import otlp
from tests.support.otel import make_sink

# The receivers' fixtures, shared with this module.
grpc_receiver = otlp.grpc_receiver
http_receiver = otlp.http_receiver

# ------------------------------------------------------------------------------------- check()


def test_check_reports_ok_for_each_signal_over_http(http_receiver, tmp_path):
    results = make_sink(http_receiver.endpoint, tmp_path).check()
    assert [r.item for r in results] == ["otel metrics", "otel logs"]
    assert all(r.ok for r in results), results
    assert f"127.0.0.1:{http_receiver.port}/v1/metrics" in results[0].message
    http_receiver.wait(lambda r: len(r.metrics) == 1 and len(r.logs) == 1)
    assert len(http_receiver.metrics[0].resource_metrics) == 0  # an empty export, no data sent


def test_check_reports_ok_over_grpc(grpc_receiver, tmp_path):
    results = make_sink(grpc_receiver.endpoint, tmp_path, protocol="grpc").check()
    assert all(r.ok for r in results), results
    assert results[0].message.startswith("grpc 127.0.0.1:")


def test_check_names_the_failure_when_nothing_listens(tmp_path):
    from tests.conftest import closed_port

    results = make_sink(f"http://127.0.0.1:{closed_port()}", tmp_path, logs=False).check()
    assert len(results) == 1 and not results[0].ok
    assert "refused" in results[0].message.lower() or "connection" in results[0].message.lower()


def test_check_reports_http_status(http_receiver, tmp_path):
    http_receiver.answers = [401]
    results = make_sink(http_receiver.endpoint, tmp_path, logs=False).check()
    assert not results[0].ok and "HTTP 401" in results[0].message


def test_check_rejects_a_bad_protocol_from_the_environment(tmp_path):
    results = make_sink("", tmp_path, environ={"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}).check()
    assert not results[0].ok and "http/json" in results[0].message
