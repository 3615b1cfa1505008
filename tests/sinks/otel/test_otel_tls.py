"""OTLP over TLS and mutual TLS, HTTP and gRPC, against real receivers with a throwaway CA."""

from __future__ import annotations

import ssl
from concurrent import futures

import pytest
import trustme

from tests.fakes.otlp import OtlpGrpcReceiver, OtlpHttpReceiver
from tests.support.otel import make_sink


@pytest.fixture(scope="module")
def ca():
    return trustme.CA()


@pytest.fixture
def pems(tmp_path, ca):
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("gpumon-client")
    paths = {name: tmp_path / f"{name}.pem" for name in ("ca", "server_key", "server_cert", "client_key", "client_cert")}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    server.private_key_pem.write_to_path(str(paths["server_key"]))
    server.cert_chain_pems[0].write_to_path(str(paths["server_cert"]))
    client.private_key_pem.write_to_path(str(paths["client_key"]))
    client.cert_chain_pems[0].write_to_path(str(paths["client_cert"]))
    return {k: str(v) for k, v in paths.items()}


def https_receiver(pems: dict[str, str], require_client: bool) -> OtlpHttpReceiver:
    receiver = OtlpHttpReceiver()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pems["server_cert"], pems["server_key"])
    if require_client:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(pems["ca"])
    receiver.server.socket = context.wrap_socket(receiver.server.socket, server_side=True)
    receiver.endpoint = f"https://127.0.0.1:{receiver.port}"
    return receiver


def test_https_with_a_private_ca(pems, tmp_path):
    receiver = https_receiver(pems, require_client=False)
    try:
        untrusted = make_sink(receiver.endpoint, tmp_path).check()
        assert not any(r.ok for r in untrusted)  # the system store does not know the throwaway CA
        trusted = make_sink(receiver.endpoint, tmp_path, certificate=pems["ca"]).check()
        assert all(r.ok for r in trusted), trusted
        receiver.wait(lambda r: len(r.metrics) >= 1)
    finally:
        receiver.close()


def test_https_mutual_tls(pems, tmp_path):
    receiver = https_receiver(pems, require_client=True)
    try:
        without = make_sink(receiver.endpoint, tmp_path, certificate=pems["ca"]).check()
        assert not any(r.ok for r in without)
        with_cert = make_sink(receiver.endpoint, tmp_path, certificate=pems["ca"],
                              client_certificate=pems["client_cert"], client_key=pems["client_key"]).check()
        assert all(r.ok for r in with_cert), with_cert
    finally:
        receiver.close()


def test_grpc_mutual_tls(pems, tmp_path):
    import grpc

    receiver = OtlpGrpcReceiver()
    receiver.server.stop(grace=None)  # rebuild on a TLS port with the same servicers
    receiver.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc

    class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
        def Export(self, request, context):  # noqa: N802 - generated name
            receiver.record("metrics", request, dict(context.invocation_metadata()))
            return metrics_service_pb2.ExportMetricsServiceResponse()

    class Logs(logs_service_pb2_grpc.LogsServiceServicer):
        def Export(self, request, context):  # noqa: N802 - generated name
            receiver.record("logs", request, dict(context.invocation_metadata()))
            return logs_service_pb2.ExportLogsServiceResponse()

    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), receiver.server)
    logs_service_pb2_grpc.add_LogsServiceServicer_to_server(Logs(), receiver.server)
    with open(pems["server_key"], "rb") as k, open(pems["server_cert"], "rb") as c, open(pems["ca"], "rb") as a:
        credentials = grpc.ssl_server_credentials([(k.read(), c.read())], root_certificates=a.read(),
                                                  require_client_auth=True)
    port = receiver.server.add_secure_port("127.0.0.1:0", credentials)
    receiver.server.start()
    try:
        endpoint = f"https://127.0.0.1:{port}"
        with_cert = make_sink(endpoint, tmp_path, protocol="grpc", certificate=pems["ca"],
                              client_certificate=pems["client_cert"], client_key=pems["client_key"]).check()
        assert all(r.ok for r in with_cert), with_cert
        receiver.wait(lambda r: len(r.metrics) >= 1 and len(r.logs) >= 1)
        without = make_sink(endpoint, tmp_path, protocol="grpc", certificate=pems["ca"], timeout=2.0).check()
        assert not any(r.ok for r in without)
    finally:
        receiver.server.stop(grace=None)
