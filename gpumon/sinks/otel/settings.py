"""The OTel sink's settings: the ``[otel]`` section, merged per signal with the standard
OTEL_EXPORTER_OTLP_* variables into one SignalSettings each."""

from __future__ import annotations

import logging
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpumon.config import Option, SectionSchema
from gpumon.identity import IMDS_URL
from gpumon.sinks.common import header_list_check, header_problem
from gpumon.sinks.options import backoff_options, tls_options

if TYPE_CHECKING:
    pass


log = logging.getLogger("gpumon.sinks.otel")


HTTP_PROTOBUF = "http/protobuf"
GRPC = "grpc"
DEFAULT_HTTP_ENDPOINT = "http://localhost:4318"
DEFAULT_GRPC_ENDPOINT = "http://localhost:4317"
DEFAULT_TIMEOUT = 10.0
SIGNALS = ("metrics", "logs")


def _kv_list_check(value: list[str]) -> str | None:
    for item in value:
        if "=" not in item or not item.partition("=")[0].strip():
            return f"entries must be KEY=VALUE (got {item!r})"
    return None


@dataclass(frozen=True)
class OtelSettings:
    """The ``[otel]`` section, parsed once; :func:`resolve_settings` merges it per signal with the
    environment into a :class:`SignalSettings`."""

    endpoint: str
    protocol: str
    headers: tuple[str, ...] = field(repr=False)  # a secret: never in a repr
    compression: str
    timeout: float
    insecure: bool
    ca_file: str
    cert_file: str
    key_file: str
    interval: float
    resource_attributes: tuple[str, ...]
    logs: bool
    azure_detect: bool
    imds_url: str
    imds_timeout: float
    max_queued_records: int
    backoff_initial: float
    backoff_max: float


OPTIONS = SectionSchema(
    "otel",
    "OTLP export of metrics (hardware semantic conventions) and events (log records). Every key left "
    "empty falls back to the standard OTEL_EXPORTER_OTLP_* variable; where both are set, this section wins.",
    (
        Option("endpoint", str, "",
               "Collector address. http/protobuf: base URL, `/v1/metrics` and `/v1/logs` are appended "
               "(like OTEL_EXPORTER_OTLP_ENDPOINT); grpc: `host:port` or `http(s)://host:port`. "
               "Empty: the OTEL_EXPORTER_OTLP_* variables, else localhost:4318 (http) / 4317 (grpc)."),
        Option("protocol", str, "", "`http/protobuf` or `grpc`; empty: OTEL_EXPORTER_OTLP_PROTOCOL, "
               "else http/protobuf.", choices=("", HTTP_PROTOBUF, GRPC)),
        Option("headers", list, [], "Extra request headers (gRPC metadata) as KEY=VALUE; merged over "
               "OTEL_EXPORTER_OTLP_HEADERS, this list winning per key. Values are never logged or printed.",
               check=header_list_check, secret=True),
        Option("compression", str, "", "`gzip` or `none`; empty: OTEL_EXPORTER_OTLP_COMPRESSION, else none.",
               choices=("", "gzip", "none")),
        Option("timeout", float, 0.0, "Seconds one export may take; 0: OTEL_EXPORTER_OTLP_TIMEOUT "
               "(milliseconds), else 10.", min=0.0, max=600.0),
        Option("insecure", bool, False, "gRPC without TLS for an endpoint given without a scheme "
               "(OTEL_EXPORTER_OTLP_INSECURE does the same). `http://` endpoints never use TLS."),
        *tls_options("collector", fallback="OTEL_EXPORTER_OTLP_CERTIFICATE (and _CLIENT_CERTIFICATE, "
                     "_CLIENT_KEY for the client pair)", ca_aliases=("certificate",),
                     cert_aliases=("client_certificate",), key_aliases=("client_key",)),
        Option("interval", float, 0.0, "Seconds between metric exports; 0 exports every new snapshot, "
               "so the export follows the collection interval.", min=0.0, max=3600.0),
        Option("resource_attributes", list, [], "Extra resource attributes as KEY=VALUE; they win over "
               "OTEL_RESOURCE_ATTRIBUTES and the detected ones.", check=_kv_list_check),
        Option("logs", bool, True, "Export events (flaps, XIDs, lost GPUs, collectors down) as log records."),
        Option("azure_detect", bool, True, "Put the host identity on the resource: cloud.* / host.* / "
               "placement from Azure IMDS (the one `[azure]` configures) and the KVP pool's physical host, "
               "as gpumon's one identity provider learns them; the first export waits at most `[azure] "
               "imds_timeout` + 0.5 s for them. Off Azure nothing answers and nothing is added."),
        Option("imds_url", str, IMDS_URL, "Deprecated alias of `[azure] imds_url`, honoured when set (with "
               "a warning); empty switches IMDS detection off for this sink."),
        Option("imds_timeout", float, 1.0, "Deprecated alias of `[azure] imds_timeout`, honoured when set "
               "(with a warning).", min=0.05, max=30.0),
        Option("max_queued_records", int, 10000, "Log records kept while the collector is unreachable; "
               "beyond this the oldest are dropped (counted).", min=1, max=10_000_000),
        *backoff_options(),
    ),
    OtelSettings,
)
IMDS_ALIASES = {"imds_url": "imds_url", "imds_timeout": "imds_timeout"}
"""This section's deprecated IMDS keys -> the ``[azure]`` keys they stand for."""


# --------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class SignalSettings:
    """Where and how one signal (metrics or logs) is sent, after config and environment are merged."""

    signal: str
    protocol: str
    endpoint: str
    """Full URL for http/protobuf; gRPC target (``host:port``) for grpc."""
    headers: tuple[tuple[str, str], ...]
    timeout: float
    compression: str
    tls: bool
    certificate: str = ""
    client_certificate: str = ""
    client_key: str = ""


def parse_kv(items: Sequence[str] | str, unquote: bool = False, headers: bool = False) -> dict[str, str]:
    """``["a=b", ...]`` or ``"a=b,c=d"`` (W3C baggage style, URL-encoded in the OTEL_* variables).

    With ``headers``, an item that is not a header gpumon can send is ignored with a warning that
    never shows its value (the OpenTelemetry SDKs ignore a malformed header the same way)."""
    if isinstance(items, str):
        items = [part for part in items.split(",") if part.strip()]
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if unquote and sep:
            key, value = urllib.parse.unquote(key), urllib.parse.unquote(value)
        if headers:
            problem = header_problem(f"{key}{sep}{value}")
            if problem:
                log.warning("otel: ignoring a header of OTEL_EXPORTER_OTLP_HEADERS: %s", problem)
                continue
        elif not sep:
            log.warning("otel: ignoring malformed KEY=VALUE item %r", item)
            continue
        key, value = key.strip(), value.strip()
        if key:
            out[key] = value
    return out


def _env(environ: Mapping[str, str], signal: str, key: str) -> str:
    """OTEL_EXPORTER_OTLP_<SIGNAL>_<KEY>, else OTEL_EXPORTER_OTLP_<KEY>, else ''."""
    return (environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_{key}", "").strip()
            or environ.get(f"OTEL_EXPORTER_OTLP_{key}", "").strip())


def resolve_settings(cfg: OtelSettings | Mapping[str, Any], signal: str, environ: Mapping[str, str]
                     ) -> SignalSettings:
    """Merge the [otel] settings over the standard variables for one signal. Config wins where set
    (an option left empty, 0 or false is not set). A section given instead of settings is parsed."""
    if not isinstance(cfg, OtelSettings):
        cfg = OPTIONS.settings_of(cfg)
    protocol = cfg.protocol or _env(environ, signal, "PROTOCOL") or HTTP_PROTOBUF
    if protocol not in (HTTP_PROTOBUF, GRPC):
        raise ValueError(f"otel protocol {protocol!r} is not supported (use {HTTP_PROTOBUF} or {GRPC})")

    if protocol == HTTP_PROTOBUF:
        path = f"/v1/{signal}"
        if cfg.endpoint:
            endpoint = _signal_url(cfg.endpoint, path)
        elif environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT", "").strip():
            endpoint = environ[f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"].strip()
        else:
            endpoint = _signal_url(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
                                   or DEFAULT_HTTP_ENDPOINT, path)
        scheme = urllib.parse.urlsplit(endpoint).scheme
        if scheme not in ("http", "https"):
            raise ValueError(f"otel endpoint {endpoint!r} must be an http:// or https:// URL")
        tls = scheme == "https"
    else:
        raw = cfg.endpoint or _env(environ, signal, "ENDPOINT") or DEFAULT_GRPC_ENDPOINT
        parts = urllib.parse.urlsplit(raw if "://" in raw else "//" + raw)
        if not parts.hostname:
            raise ValueError(f"otel endpoint {raw!r} has no host")
        insecure_env = _env(environ, signal, "INSECURE").lower() in ("true", "1", "yes")
        if parts.scheme == "https":
            tls = True
        elif parts.scheme == "http":
            tls = False
        else:
            tls = not (cfg.insecure or insecure_env)
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        endpoint = f"{host}:{parts.port or 4317}"

    headers = parse_kv(_env(environ, signal, "HEADERS"), unquote=True, headers=True)
    headers.update(parse_kv(cfg.headers or (), headers=True))

    timeout = float(cfg.timeout or 0.0)
    if not timeout:
        text = _env(environ, signal, "TIMEOUT")
        try:
            timeout = float(text) / 1000.0 if text else DEFAULT_TIMEOUT
        except ValueError:
            log.warning("otel: ignoring OTEL_EXPORTER_OTLP_TIMEOUT=%r (not a number of milliseconds)", text)
            timeout = DEFAULT_TIMEOUT
        if timeout <= 0:
            timeout = DEFAULT_TIMEOUT

    compression = (cfg.compression or _env(environ, signal, "COMPRESSION") or "none").lower()
    if compression not in ("gzip", "none"):
        log.warning("otel: unsupported compression %r, sending uncompressed", compression)
        compression = "none"

    return SignalSettings(
        signal=signal,
        protocol=protocol,
        endpoint=endpoint,
        headers=tuple(headers.items()),
        timeout=timeout,
        compression=compression,
        tls=tls,
        certificate=cfg.ca_file or _env(environ, signal, "CERTIFICATE"),
        client_certificate=cfg.cert_file or _env(environ, signal, "CLIENT_CERTIFICATE"),
        client_key=cfg.key_file or _env(environ, signal, "CLIENT_KEY"),
    )


def _signal_url(base: str, path: str) -> str:
    """Append ``/v1/<signal>`` to a base URL unless it already names a signal path."""
    base = base.rstrip("/")
    for known in ("/v1/metrics", "/v1/logs"):
        if base.endswith(known):
            base = base[: -len(known)]
            break
    return base + path
