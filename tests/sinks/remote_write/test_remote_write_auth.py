"""How the remote_write sink proves who it is: basic auth, a bearer token file (rotated), TLS with a
private CA, mutual TLS, and an Entra ID token for an Azure Monitor workspace's metrics ingestion
endpoint (the real ManagedIdentityCredential against a loopback IMDS, an HTTPS stand-in endpoint)."""

from __future__ import annotations

import base64

import pytest
import trustme

from tests.conftest import wait_for
from tests.fakes.remote_write import Receiver, delivered, make_sink, small_snapshot

T0 = 1_760_000_000.0
DCR = "dcr-00000000000000000000000000000001"
AZURE_PATH = (f"/dataCollectionRules/{DCR}/streams/Microsoft-PrometheusMetrics/api/v1/write"
              "?api-version=2023-04-24")


@pytest.fixture
def ca(tmp_path):
    authority = trustme.CA()
    authority.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    return authority


def send_one(sink) -> None:
    sink.start()
    try:
        sink.publish(small_snapshot(T0))
        wait_for(lambda: delivered(sink), timeout=10)
    finally:
        sink.stop(1.0)


def test_basic_auth_from_a_password_file(tmp_path):
    (tmp_path / "password").write_text("s3cret\n")
    expected = "Basic " + base64.b64encode(b"gpumon:s3cret").decode()
    server = Receiver(token=expected)
    try:
        send_one(make_sink(tmp_path, server.url, auth="basic", username="gpumon",
                           password_file=str(tmp_path / "password")))
        assert server.samples() == 4
    finally:
        server.close()


def test_bearer_token_file_is_reread_so_a_rotated_token_is_used(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("first\n")
    server = Receiver(token="Bearer first")
    sink = make_sink(tmp_path, server.url, auth="bearer", bearer_token_file=str(token_file))
    sink.start()
    try:
        sink.publish(small_snapshot(T0))
        wait_for(lambda: delivered(sink))
        token_file.write_text("second\n")
        server.token = "Bearer second"
        sink.publish(small_snapshot(T0 + 1))
        wait_for(lambda: server.samples() == 8)
        assert server.refused == []
    finally:
        sink.stop(1.0)
        server.close()


def test_https_with_a_private_ca_and_mutual_tls(tmp_path, ca):
    client = ca.issue_cert("gpumon-client")
    client.cert_chain_pems[0].write_to_path(str(tmp_path / "client.pem"))
    client.private_key_pem.write_to_path(str(tmp_path / "client.key"))
    server = Receiver(tls=ca.issue_cert("127.0.0.1"), client_ca=ca)
    try:
        send_one(make_sink(tmp_path, server.url, ca_file=str(tmp_path / "ca.pem"),
                           cert_file=str(tmp_path / "client.pem"), key_file=str(tmp_path / "client.key")))
        assert server.samples() == 4
        without = make_sink(tmp_path / "other", server.url, ca_file=str(tmp_path / "ca.pem"))
        without.start()
        try:
            without.publish(small_snapshot(T0))
            wait_for(lambda: without.health().failed > 0)
            assert without.health().exported == 0 and server.samples() == 4
        finally:
            without.stop(0.5)
    finally:
        server.close()


def test_an_untrusted_certificate_is_refused(tmp_path, ca):
    server = Receiver(tls=trustme.CA().issue_cert("127.0.0.1"))
    sink = make_sink(tmp_path, server.url, ca_file=str(tmp_path / "ca.pem"))
    sink.start()
    try:
        sink.publish(small_snapshot(T0))
        wait_for(lambda: sink.health().failed > 0)
        assert "CERTIFICATE_VERIFY_FAILED" in sink.health().detail and server.received == []
    finally:
        sink.stop(0.5)
        server.close()


def test_entra_id_managed_identity_token_for_an_azure_monitor_workspace(tmp_path, ca, monkeypatch):
    from tests.fakes.imds import ImdsServer
    from tests.fakes.logs_ingestion import AUDIENCE
    from tests.fakes.tokens import token_audience

    def accepts(header):
        claims = token_audience(header[len("Bearer "):]) if header and header.startswith("Bearer ") else None
        return claims is not None and claims[0].rstrip("/") == AUDIENCE

    imds = ImdsServer()
    monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", imds.url)
    server = Receiver(tls=ca.issue_cert("127.0.0.1"), accepts=accepts, path=AZURE_PATH)
    try:
        sink = make_sink(tmp_path, server.url, auth="azure", ca_file=str(tmp_path / "ca.pem"))
        sink.start()
        try:
            for i in range(3):
                sink.publish(small_snapshot(T0 + i))
            wait_for(lambda: server.samples() == 12, timeout=10)
        finally:
            sink.stop(1.0)
        assert server.refused == [] and server.paths[0] == AZURE_PATH
        assert imds.token_requests == 1  # the token is kept until near its expiry
    finally:
        server.close()
        imds.close()


def test_entra_id_without_an_identity_is_a_configuration_fault_that_keeps_the_samples(tmp_path, ca, monkeypatch):
    from tests.fakes.imds import ImdsServer

    imds = ImdsServer()
    imds.identity = False
    monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", imds.url)
    server = Receiver(tls=ca.issue_cert("127.0.0.1"), path=AZURE_PATH)
    sink = make_sink(tmp_path, server.url, auth="azure", ca_file=str(tmp_path / "ca.pem"))
    sink.start()
    try:
        sink.publish(small_snapshot(T0))
        wait_for(lambda: sink.health().failed > 0, timeout=10)
        health = sink.health()
        assert "no token (managed_identity)" in health.detail and health.dropped == 0
        assert health.extra["requests_queued"] == 1 and server.times == []
        imds.identity = True
        wait_for(lambda: delivered(sink), timeout=10)
    finally:
        sink.stop(1.0)
        server.close()
        imds.close()
