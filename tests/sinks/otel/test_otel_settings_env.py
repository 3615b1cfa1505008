"""Endpoint, protocol, headers, timeout, compression and TLS: the [otel] section merged over the
standard OTEL_EXPORTER_OTLP_* variables, the section winning where both are set."""

from __future__ import annotations

import pytest

from gpumon.config import ConfigError, load
from gpumon.sinks.otel import OPTIONS, resolve_settings


def cfg(**values):
    base = {opt.key: opt.default for opt in OPTIONS.options}
    base.update(values)
    return base


def test_defaults_are_the_otlp_defaults():
    s = resolve_settings(cfg(), "metrics", {})
    assert (s.protocol, s.endpoint, s.timeout, s.compression, s.tls) == (
        "http/protobuf", "http://localhost:4318/v1/metrics", 10.0, "none", False)
    g = resolve_settings(cfg(protocol="grpc"), "logs", {})
    assert (g.endpoint, g.tls) == ("localhost:4317", False)


def test_http_endpoint_is_a_base_url_and_signal_paths_are_appended():
    assert resolve_settings(cfg(endpoint="https://otel.example:4318/"), "logs", {}).endpoint == \
        "https://otel.example:4318/v1/logs"
    assert resolve_settings(cfg(endpoint="http://c:4318/v1/metrics"), "logs", {}).endpoint == "http://c:4318/v1/logs"
    s = resolve_settings(cfg(endpoint="https://otel.example"), "metrics", {})
    assert s.tls and s.endpoint == "https://otel.example/v1/metrics"


def test_environment_applies_when_the_section_is_silent():
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://envhost:4318",
        "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": "http://logs-only:9999/custom/path",
        "OTEL_EXPORTER_OTLP_HEADERS": "api-key=s%3Dcret,tenant=a",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "2500",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
        "OTEL_EXPORTER_OTLP_CERTIFICATE": "/etc/ca.pem",
    }
    metrics = resolve_settings(cfg(), "metrics", env)
    logs = resolve_settings(cfg(), "logs", env)
    assert metrics.endpoint == "http://envhost:4318/v1/metrics"
    assert logs.endpoint == "http://logs-only:9999/custom/path"  # per-signal variable is used as-is
    assert dict(metrics.headers) == {"api-key": "s=cret", "tenant": "a"}
    assert metrics.timeout == 2.5 and metrics.compression == "gzip" and metrics.certificate == "/etc/ca.pem"


def test_section_wins_over_environment():
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://envhost:4318",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://envhost:4318/v1/metrics",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_HEADERS": "tenant=env,keep=1",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "2500",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
    }
    s = resolve_settings(cfg(endpoint="http://cfg:4318", protocol="http/protobuf", headers=["tenant=cfg"],
                             timeout=3.0, compression="none"), "metrics", env)
    assert s.endpoint == "http://cfg:4318/v1/metrics" and s.protocol == "http/protobuf"
    assert dict(s.headers) == {"tenant": "cfg", "keep": "1"}
    assert s.timeout == 3.0 and s.compression == "none"


def test_grpc_tls_follows_scheme_then_insecure():
    assert resolve_settings(cfg(protocol="grpc", endpoint="https://c:4317"), "metrics", {}).tls
    assert not resolve_settings(cfg(protocol="grpc", endpoint="http://c:4317"), "metrics", {}).tls
    assert resolve_settings(cfg(protocol="grpc", endpoint="c:4317"), "metrics", {}).tls
    assert not resolve_settings(cfg(protocol="grpc", endpoint="c:4317", insecure=True), "metrics", {}).tls
    assert not resolve_settings(cfg(protocol="grpc", endpoint="c"), "metrics",
                                {"OTEL_EXPORTER_OTLP_INSECURE": "true"}).tls
    assert resolve_settings(cfg(protocol="grpc", endpoint="c"), "metrics", {}).endpoint == "c:4317"
    assert resolve_settings(cfg(protocol="grpc", endpoint="[::1]:5317"), "metrics", {}).endpoint == "[::1]:5317"


@pytest.mark.parametrize(("env", "problem"), [
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "http/json"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "ftp://c"}, "http:// or https://"),
])
def test_unusable_environment_is_a_clear_error(env, problem):
    with pytest.raises(ValueError, match=problem.replace("/", ".")):
        resolve_settings(cfg(), "metrics", env)


def test_bad_timeout_variable_falls_back_to_the_default(caplog):
    assert resolve_settings(cfg(), "metrics", {"OTEL_EXPORTER_OTLP_TIMEOUT": "soon"}).timeout == 10.0
    assert "OTEL_EXPORTER_OTLP_TIMEOUT" in caplog.text


def test_section_loads_from_toml_and_gpumon_variables(tmp_path):
    path = tmp_path / "gpumon.toml"
    path.write_text('[otel]\nprotocol = "grpc"\nheaders = ["a=b"]\ninterval = 15\n')
    config = load([OPTIONS], str(path), environ={"GPUMON_OTEL_ENDPOINT": "http://c:4317"})
    section = config["otel"]
    assert (section.protocol, section.endpoint, section.headers, section.interval) == (
        "grpc", "http://c:4317", ["a=b"], 15.0)
    path.write_text('[otel]\nheaders = ["novalue"]\n')
    with pytest.raises(ConfigError, match="not NAME=VALUE"):
        load([OPTIONS], str(path), environ={})
    path.write_text('[otel]\nprotocol = "http/json"\n')
    with pytest.raises(ConfigError, match="protocol"):
        load([OPTIONS], str(path), environ={})
