"""Secrets never reach a message: a mistyped header or a password of the wrong type is an exit-2 line
that names the key and the file without the value; a malformed OTEL_EXPORTER_OTLP_HEADERS item is a
warning without it; and a receiver that echoes the request's headers (or answers in binary) has its
answer redacted and cleaned before it is logged, counted or printed by `gpumon check`."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time
from typing import Any

import pytest

from gpumon.cli import schemas
from gpumon.config import ConfigError, load
from gpumon.sinks.otel.settings import resolve_settings
from tests.conftest import clean_env, wait_for
from tests.fakes.otlp import EchoingOtlpReceiver
from tests.fakes.remote_write import Receiver, Reply, make_sink, small_snapshot
from tests.support.otel import make_sink as make_otel_sink
from tests.support.otel import snapshot

SECRET = "tok-9f8e7d6c5b4a"
T0 = 1_760_000_000.0

BAD_SECRETS = {
    # name: (config text, the key the message must name)
    "remote_write header with a colon": (
        f'[remote_write]\nurl = "http://127.0.0.1:1/api/v1/write"\nheaders = ["Authorization: Bearer {SECRET}"]\n',
        "[remote_write] headers"),
    "remote_write header with base64 padding": (
        f'[remote_write]\nurl = "http://127.0.0.1:1/w"\nheaders = ["Authorization: Basic {SECRET}=="]\n',
        "[remote_write] headers"),
    "remote_write header with a line break": (
        f'[remote_write]\nurl = "http://127.0.0.1:1/w"\nheaders = ["X-Token={SECRET}\\r\\nX-Injected: 1"]\n',
        "[remote_write] headers"),
    "otel header that is the token alone": (f'[otel]\nheaders = ["{SECRET}"]\n', "[otel] headers"),
    "otel header with a colon": (f'[otel]\nheaders = ["Authorization: Bearer {SECRET}"]\n', "[otel] headers"),
    "otel header not a list of strings": (f'[otel]\nheaders = ["a=b", {{x = "{SECRET}"}}]\n', "[otel] headers"),
    "remote_write password a number": ("[remote_write]\npassword = 98765432123\n", "[remote_write] password"),
    "remote_write client_secret a list": (f'[remote_write]\nclient_secret = ["{SECRET}"]\n',
                                          "[remote_write] client_secret"),
    "azure_monitor client_secret a number": ("[azure_monitor]\nclient_secret = 98765432123\n",
                                             "[azure_monitor] client_secret"),
}


@pytest.mark.parametrize("name", sorted(BAD_SECRETS))
def test_a_misconfigured_secret_is_an_error_naming_key_and_file_without_the_value(tmp_path, name):
    text, key = BAD_SECRETS[name]
    path = tmp_path / "gpumon.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load(schemas(), str(path), {}, {})
    assert err.value.source == str(path) and err.value.key == key
    message = str(err.value)
    assert SECRET not in message and "98765432123" not in message
    assert "\n" not in message and "\r" not in message


def test_gpumon_check_prints_the_header_error_without_the_credential(tmp_path):
    path = tmp_path / "gpumon.toml"
    path.write_text(BAD_SECRETS["remote_write header with a colon"][0])
    done = subprocess.run([sys.executable, "-m", "gpumon", "check", "--config", str(path)], env=clean_env(),
                          capture_output=True, text=True, timeout=20)
    assert done.returncode == 2
    assert "[remote_write] headers" in done.stderr and str(path) in done.stderr
    assert "'Authorization'" in done.stderr  # the header is named, so the fix is plain
    assert SECRET not in done.stderr + done.stdout


def test_a_malformed_otlp_headers_variable_is_ignored_with_a_warning_without_the_value(caplog):
    environ = {"OTEL_EXPORTER_OTLP_HEADERS": f"Authorization: Bearer%20{SECRET},x-ok=1,"
                                             f"x-crlf={SECRET}%0D%0AInjected:%201"}
    with caplog.at_level(logging.WARNING, logger="gpumon.sinks.otel"):
        settings = resolve_settings({}, "metrics", environ)
    assert dict(settings.headers) == {"x-ok": "1"}
    assert len(caplog.records) == 2 and "'Authorization'" in caplog.text and "'x-crlf'" in caplog.text
    assert SECRET not in caplog.text


# ------------------------------------------------------------------- receivers that echo credentials


def clean_line(text: str) -> bool:
    """One line of printable text: no newline to forge a log line, no escape sequence, no NUL."""
    return not re.search(r"[\x00-\x1f\x7f]", text)


def test_a_remote_write_receiver_echoing_headers_has_them_redacted(tmp_path, caplog):
    token = tmp_path / "token"
    token.write_text(SECRET + "\n")
    receiver = Receiver()
    receiver.default = Reply(400, body="refused, you sent:\n", echo=True)
    sink = make_sink(tmp_path, receiver.url, auth="bearer", bearer_token_file=str(token),
                     headers=["X-Scope-OrgID=tenant-0042"])
    sink.start()
    try:
        with caplog.at_level(logging.WARNING, logger="gpumon.sinks.remote_write"):
            sink.publish(small_snapshot(T0))
            wait_for(lambda: sink.health().dropped == 4)
        detail = sink.health().detail
        checked = sink.check()[0].message
    finally:
        sink.stop(1.0)
        receiver.close()
    assert "<redacted>" in detail and "refused, you sent" in detail
    for text in (caplog.text, detail, checked):
        assert SECRET not in text and "tenant-0042" not in text
    for message in [r.getMessage() for r in caplog.records] + [detail, checked]:
        assert clean_line(message), repr(message)


def test_a_binary_answer_is_described_not_logged(tmp_path, caplog):
    receiver = Receiver()
    receiver.default = Reply(400, body="\x00\x89PNG\r\n\x1a\n" + "\x00\x01\x02\x03" * 40)
    sink = make_sink(tmp_path, receiver.url)
    sink.start()
    try:
        with caplog.at_level(logging.WARNING, logger="gpumon.sinks.remote_write"):
            sink.publish(small_snapshot(T0))
            wait_for(lambda: sink.health().dropped == 4)
        detail = sink.health().detail
    finally:
        sink.stop(1.0)
        receiver.close()
    assert "bytes, not text" in detail and "PNG" not in detail
    assert all(clean_line(r.getMessage()) for r in caplog.records)


@pytest.mark.parametrize("content, says", [
    (f"{SECRET}\nX-Injected: 1\n".encode(), "not valid HTTP"),
    (SECRET.encode() + b"\xff\xfe", "not UTF-8"),
], ids=["line-break", "not-utf8"])
def test_a_token_file_that_cannot_be_a_header_is_a_configuration_fault_without_the_token(tmp_path, content,
                                                                                          says):
    token = tmp_path / "token"
    token.write_bytes(content)
    receiver = Receiver()
    sink = make_sink(tmp_path, receiver.url, auth="bearer", bearer_token_file=str(token))
    sink.start()
    try:
        sink.publish(small_snapshot(T0))
        wait_for(lambda: sink.health().failed > 0)
        health = sink.health()
    finally:
        sink.stop(1.0)
        receiver.close()
    assert says in health.detail and SECRET not in health.detail and "xff" not in health.detail
    assert receiver.times == [] and health.dropped == 0 and health.extra["requests_queued"] == 1


def test_an_otlp_receiver_echoing_the_authorization_header_has_it_redacted(tmp_path, caplog):
    receiver = EchoingOtlpReceiver()
    sink = make_otel_sink(receiver.endpoint, tmp_path, logs=False, headers=[f"Authorization=Bearer {SECRET}"])
    sink.start()
    try:
        with caplog.at_level(logging.WARNING, logger="gpumon.sinks.otel"):
            sink.publish(snapshot(time.time(), 1.0, 1.0))
            wait_for(lambda: sink.health().failed >= 1)
        detail = sink.health().detail
        checked = [r.message for r in sink.check()]
    finally:
        sink.stop(1)
        receiver.close()
    assert "HTTP 400 bad credentials" in detail and "<redacted>" in detail
    for text in [caplog.text, detail, *checked]:
        assert SECRET not in text
    for message in [r.getMessage() for r in caplog.records] + [detail, *checked]:
        assert clean_line(message), repr(message)


def test_a_grpc_collector_echoing_the_metadata_has_it_redacted(tmp_path, caplog):
    """gRPC: the status message of a collector that quotes the call's authorization metadata."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc

    class Echoing(metrics_service_pb2_grpc.MetricsServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - generated name
            sent = dict(context.invocation_metadata()).get("authorization", "")
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"refused {sent}\nCRITICAL forged line")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Echoing(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    sink = make_otel_sink(f"http://127.0.0.1:{port}", tmp_path, protocol="grpc", logs=False,
                          headers=[f"Authorization=Bearer {SECRET}"])
    sink.start()
    try:
        with caplog.at_level(logging.WARNING, logger="gpumon.sinks.otel"):
            sink.publish(snapshot(time.time(), 1.0, 1.0))
            wait_for(lambda: sink.health().failed >= 1)
        detail = sink.health().detail
    finally:
        sink.stop(1)
        server.stop(grace=None)
    assert "UNAUTHENTICATED: refused <redacted>" in detail
    assert SECRET not in caplog.text + detail
    assert all(clean_line(m) for m in [r.getMessage() for r in caplog.records] + [detail])
