"""TLS, mutual TLS and basic auth from an exporter-toolkit web-config file, with real sockets."""

from __future__ import annotations

import base64
import socket
import ssl
import subprocess
import sys

import bcrypt
import pytest
import trustme

from gpumon.config import ConfigError, Section
from gpumon.sinks.base import SinkContext
from gpumon.sinks.prometheus import OPTIONS, PrometheusSink
from gpumon.sinks.prometheus.webconfig import load_web_config
from tests.conftest import clean_env, http_get
from tests.support.endpoint import snapshot

HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()


@pytest.fixture(scope="module")
def ca():
    return trustme.CA()


@pytest.fixture
def files(tmp_path, ca):
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    return tmp_path


def start(path) -> PrometheusSink:
    values = {o.key: o.default for o in OPTIONS.options}
    values.update(listen="127.0.0.1:0", web_config_file=str(path), request_timeout=2.0)
    s = PrometheusSink(SinkContext("h", "/tmp", "1"), Section("prometheus", values))
    s.start()
    s.publish(snapshot())
    return s


def client_context(ca, tmp_path, with_cert: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    if with_cert:
        ca.issue_cert("scraper").configure_cert(ctx)
    return ctx


def test_tls_and_basic_auth(files, ca):
    web = files / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: server.pem\n  key_file: server.pem\n"
                   f"basic_auth_users:\n  prometheus: '{HASH}'\n")
    s = start(web)
    try:
        ctx = client_context(ca, files)
        base = f"https://127.0.0.1:{s.port}"
        status, headers, body = http_get(base + "/metrics", context=ctx)
        assert status == 401 and body == b"Unauthorized\n" and "WWW-Authenticate" in headers
        wrong = {"Authorization": "Basic " + base64.b64encode(b"prometheus:nope").decode()}
        assert http_get(base + "/metrics", wrong, context=ctx)[0] == 401
        assert http_get(base + "/healthz", wrong, context=ctx)[0] == 401  # nothing is revealed
        good = {"Authorization": "Basic " + base64.b64encode(b"prometheus:s3cret").decode()}
        for _ in range(3):  # the second and third use the success cache
            status, _, body = http_get(base + "/metrics", good, context=ctx)
            assert status == 200 and b"gpumon_test_value" in body
        # plain HTTP to the TLS port is dropped, and valid scrapes continue
        with socket.create_connection(("127.0.0.1", s.port), timeout=5) as conn:
            conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            try:
                reply = conn.recv(65536)
            except ConnectionResetError:
                reply = b""
            assert b"gpumon_test_value" not in reply
        assert http_get(base + "/metrics", good, context=ctx)[0] == 200
        assert s.health().failed >= 1
    finally:
        s.stop()


def test_mutual_tls_requires_a_client_certificate(files, ca):
    web = files / "web.yml"
    web.write_text("tls_server_config:\n  cert_file: server.pem\n  key_file: server.pem\n"
                   "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.pem\n"
                   "  min_version: TLS13\n")
    s = start(web)
    try:
        base = f"https://127.0.0.1:{s.port}/metrics"
        with pytest.raises((ssl.SSLError, OSError)):
            http_get(base, context=client_context(ca, files))
        assert http_get(base, context=client_context(ca, files, with_cert=True))[0] == 200
    finally:
        s.stop()


@pytest.mark.parametrize("text, key", [
    ("tls_server_config:\n  cert_file: server.pem\n", "tls_server_config.cert_file"),
    ("tls_server_config:\n  cert_file: nope.pem\n  key_file: nope.pem\n", "tls_server_config.cert_file"),
    ("tls_server_config:\n  cert_file: server.pem\n  key_file: server.pem\n  client_auth_type: Maybe\n",
     "tls_server_config.client_auth_type"),
    ("tls_server_config:\n  cert_file: server.pem\n  key_file: server.pem\n"
     "  client_auth_type: RequireAndVerifyClientCert\n", "tls_server_config.client_ca_file"),
    ("tls_server_config:\n  cert_file: server.pem\n  key_file: server.pem\n  min_version: TLS10\n",
     "tls_server_config.min_version"),
    ("basic_auth_users:\n  bob: plaintext\n", "basic_auth_users.bob"),
    ("basic_auth_users:\n  bob: $2y$10$notreallyahash\n", "basic_auth_users.bob"),
    ("basic_auth_users:\n  bob: \"$2y$10$\u00e9\"\n", "basic_auth_users.bob"),
    ("http_server_config:\n  headers:\n    X-A: \"ok\\r\\nSet-Cookie: x\"\n", "http_server_config.headers"),
    ("tls_server_config:\n  cert_file: server.pem\n  key_file: server.pem\n  min_version: [TLS12]\n",
     "tls_server_config.min_version"),
    ("tls_server_config:\n  cert_file: server.pem\n  key_file: server.pem\n  min_version: TLS13\n"
     "  max_version: TLS12\n", "tls_server_config.max_version"),
    ("tls_server_config:\n  cert_file: server.pem\n  key_file: server.pem\n  client_auth_type: [x]\n",
     "tls_server_config.client_auth_type"),
    ("basic_auth_user:\n  bob: x\n", "basic_auth_user"),
    ("tls_server_config: [\n", "(syntax)"),
    ("- a\n- b\n", "(top level)"),
])
def test_bad_web_config_names_the_key(files, text, key):
    web = files / "web.yml"
    web.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_web_config(str(web))
    assert err.value.key == key and err.value.source == str(web)


def test_unknown_users_cost_the_same_bcrypt_check(files):
    """Timing must not tell valid user names apart: an unknown user is checked against a dummy hash."""
    import time

    web = files / "web.yml"
    slow = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=10)).decode()
    web.write_text(f"basic_auth_users:\n  prometheus: '{slow}'\n")
    config = load_web_config(str(web))

    def cost(user: bytes) -> float:
        header = "Basic " + base64.b64encode(user + b":wrong").decode()
        t0 = time.perf_counter()
        assert not config.authorized(header)
        return time.perf_counter() - t0

    known, unknown = cost(b"prometheus"), cost(b"nobody")
    assert unknown > known / 4  # both pay a cost-10 bcrypt; a short cut would be ~1000x cheaper


def test_bad_web_config_exits_2(files):
    web = files / "web.yml"
    web.write_text("basic_auth_users:\n  bob: plaintext\n")
    # a state directory of its own: the host's /var/lib/gpumon may be held by a gpumon already running there
    result = subprocess.run([sys.executable, "-m", "gpumon", "run", "--listen", "127.0.0.1:0"],
                            env=clean_env(GPUMON_PROMETHEUS_WEB_CONFIG_FILE=str(web),
                                          GPUMON_DAEMON_STATE_DIR=str(files / "state")),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and f"{web}: basic_auth_users.bob" in result.stderr
