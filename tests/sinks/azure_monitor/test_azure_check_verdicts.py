"""`gpumon check` for the Azure sink: a token, an empty probe per stream, one clear verdict per fault."""

from __future__ import annotations

import pytest

from gpumon.sinks.azure_monitor import AzureMonitorSink
from gpumon.sinks.base import SinkContext
from tests.fakes import logs_ingestion
from tests.fakes.imds import ImdsServer
from tests.fakes.logs_ingestion import IngestionServer, UndeclaredStreamIs400
from tests.fakes.tokens import FakeCredential


@pytest.fixture
def server():
    with IngestionServer() as srv:
        yield srv


@pytest.fixture
def imds(monkeypatch):
    srv = ImdsServer(client_ids=("9b7f0000-0000-4000-8000-00000000abcd",))
    monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", srv.url)
    for var in ("IDENTITY_ENDPOINT", "IDENTITY_HEADER", "MSI_ENDPOINT", "AZURE_FEDERATED_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    yield srv
    srv.close()


def check(server, tmp_path, credential=None, **options):
    cfg = {"endpoint": server.endpoint, "dcr_immutable_id": server.dcr_id, "ca_bundle": server.ca_path,
           "imds_url": "", "timeout": 2.0, **options}
    sink = AzureMonitorSink(SinkContext("node-1", str(tmp_path), "test"), cfg, credential=credential)
    return sink.check()


def test_all_good_with_the_real_managed_identity_credential(server, imds, tmp_path):
    results = check(server, tmp_path, client_id="9b7f0000-0000-4000-8000-00000000abcd")
    assert [r.ok for r in results] == [True] * 4, results
    assert "managed_identity client id 9b7f0000" in results[0].message
    assert all(r.rows == 0 for r in server.requests())  # probes carry no rows
    assert len(server.requests()) == 3


def test_no_identity_assigned(server, imds, tmp_path):
    imds.identity = False
    (result,) = check(server, tmp_path)
    assert not result.ok
    assert "no token from managed_identity (system-assigned)" in result.message
    assert "Identity not found" in result.message


def test_wrong_audience(server, tmp_path):
    results = check(server, tmp_path, credential=FakeCredential(audience_override="https://management.azure.com"))
    assert results[0].ok  # a token was issued...
    assert not any(r.ok for r in results[1:])  # ...but the endpoint refuses it
    assert "401" in results[1].message and "audience" in results[1].message


def test_role_missing(server, tmp_path):
    server.forbid()
    results = check(server, tmp_path, credential=FakeCredential(), client_id="cid-42")
    assert not results[1].ok
    assert "Monitoring Metrics Publisher" in results[1].message
    assert server.dcr_id in results[1].message and "cid-42" in results[1].message


def test_wrong_dcr(server, tmp_path):
    results = check(server, tmp_path, credential=FakeCredential(), dcr_immutable_id="dcr-ffffffffffffffff")
    assert not results[1].ok
    assert "404" in results[1].message and "dcr-ffffffffffffffff" in results[1].message


def test_wrong_stream_is_named(server, tmp_path):
    results = check(server, tmp_path, credential=FakeCredential(), stream_events="Custom-GpuMonEvent_CL")
    assert [r.ok for r in results] == [True, True, True, False]
    assert "Custom-GpuMonEvent_CL" in results[3].message and "404" in results[3].message


def test_wrong_stream_answered_with_400_fails_the_check(monkeypatch, tmp_path):
    monkeypatch.setattr(logs_ingestion, "_IngestHandler", UndeclaredStreamIs400)
    with IngestionServer() as server:
        results = check(server, tmp_path, credential=FakeCredential(), stream_events="Custom-GpuMonEvent_CL")
    assert [r.ok for r in results] == [True, True, True, False]
    assert "400" in results[3].message and "Custom-GpuMonEvent_CL" in results[3].message
    assert "dcr-00000000000000000000000000000001" in results[3].message and "not declared" in results[3].message


def test_a_400_that_does_not_name_the_stream_is_reachable_and_authorised(server, tmp_path):
    """The service's answer to an empty body is not documented: only a 400 naming the stream, the DCR
    or the api-version fails the check; any other says the endpoint, token and role are right."""
    server.fail(400, stream="Custom-GpuMonInfiniBand_CL")
    results = check(server, tmp_path, credential=FakeCredential())
    assert [r.ok for r in results] == [True, True, True, True]
    assert "reachable and authorised" in results[2].message and "refused" in results[2].message


def test_endpoint_unreachable(server, tmp_path):
    server.refuse()
    results = check(server, tmp_path, credential=FakeCredential())
    assert not results[1].ok and "unreachable" in results[1].message


def test_missing_endpoint_is_a_config_verdict(server, tmp_path):
    (result,) = check(server, tmp_path, credential=FakeCredential(), endpoint="")
    assert not result.ok and "endpoint" in result.message and "required" in result.message
