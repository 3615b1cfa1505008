"""A client of the Prometheus HTTP query API (``/api/v1/query``, ``/api/v1/rules``).

Any compatible server answers it: Prometheus, Thanos Query, Mimir, VictoriaMetrics and an Azure
Monitor workspace's query endpoint. Queries are POSTed form-encoded (a job of a thousand hosts makes a
long expression; the API accepts POST for exactly that). Authentication: none, basic from the URL's
user information, a bearer token read from a file on every request, or an Entra ID token made by the same credential code the remote write sink
uses (:func:`gpumon.sinks.azure_identity.make_credential`).
"""

from __future__ import annotations

import json
import math
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from gpumon import __version__
from gpumon.sinks.azure_identity import make_credential
from gpumon.sinks.common import read_regular_file
from gpumon.sinks.remote_write.transport import basic_authorization, tls_context

AZURE_AUDIENCE = "https://prometheus.monitor.azure.com"
"""The resource an Azure Monitor workspace's query endpoint takes tokens for (Azure docs, "Query
Prometheus metrics using the API and PromQL")."""
_TOKEN_MARGIN = 300.0
_BODY_MAX = 64 << 20
_SECRET_MAX = 64 << 10


class QueryFailed(Exception):
    """The server could not be asked or refused the query; the message says which and why."""


class Unreachable(QueryFailed):
    """No answer at the URL: refused, unresolvable, timed out, or TLS failed."""


@dataclass(frozen=True)
class Auth:
    """How to authenticate; the Azure fields are those of [remote_write] with ``auth = "azure"``."""

    kind: str = "none"                 # none, bearer, azure
    bearer_token_file: str = ""
    credential: str = "default"        # managed_identity, workload_identity, service_principal, default
    client_id: str = ""
    tenant_id: str = ""
    client_secret: str = ""
    audience: str = AZURE_AUDIENCE


@dataclass(frozen=True)
class Sample:
    labels: dict[str, str]
    value: float


class Client:
    """Instant queries against one server; each request bounded by ``timeout`` seconds."""

    def __init__(self, url: str, auth: Auth | None = None, timeout: float = 10.0, ca_file: str = "") -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--prometheus must be an http:// or https:// URL, got {url!r}")
        #: requests go here and messages show it: without user information (a password in the URL),
        #: which becomes basic auth instead (Grafana Cloud and Mimir gateways hand out such URLs)
        self.url = self.shown = urllib.parse.urlunsplit(
            parts._replace(netloc=parts.netloc.rpartition("@")[2])).rstrip("/")
        self._basic = basic_authorization(urllib.parse.unquote(parts.username or ""),
                                          urllib.parse.unquote(parts.password or "")) if parts.username else None
        self.auth = auth or Auth()
        self.timeout = timeout
        self._context: ssl.SSLContext | None = tls_context(ca_file) if parts.scheme == "https" else None
        self._credential: Any = None
        self._token: Any = None
        if self.auth.kind == "azure":
            self._credential = make_credential(self.auth, "gpumon job")

    def _authorization(self) -> str | None:
        if self.auth.kind == "bearer":
            try:
                token = read_regular_file(self.auth.bearer_token_file, _SECRET_MAX).decode("utf-8").strip()
            except OSError as exc:
                raise QueryFailed(f"cannot read the bearer token file: {exc}") from None
            return f"Bearer {token}"
        if self.auth.kind == "azure":
            if self._token is None or self._token.expires_on - time.time() < _TOKEN_MARGIN:
                try:
                    self._token = self._credential.get_token(self.auth.audience.rstrip("/") + "/.default")
                except Exception as exc:  # noqa: BLE001 - azure-identity raises its own classes
                    raise QueryFailed(f"no Entra ID token ({self.auth.credential}): {exc}") from None
            return f"Bearer {self._token.token}"
        return self._basic

    def _request(self, path: str, form: dict[str, str] | None = None) -> Any:
        """The ``data`` of the API's JSON envelope; QueryFailed with the server's own words otherwise."""
        data = urllib.parse.urlencode(form).encode() if form is not None else None
        request = urllib.request.Request(self.url + path, data=data, method="POST" if data is not None else "GET")
        request.add_header("User-Agent", f"gpumon/{__version__}")
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/x-www-form-urlencoded")
        authorization = self._authorization()
        if authorization:
            request.add_header("Authorization", authorization)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self._context) as response:
                body = response.read(_BODY_MAX)
        except urllib.error.HTTPError as exc:
            raise QueryFailed(self._http_error(exc)) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, ssl.SSLError) as exc:
            reason = getattr(exc, "reason", exc)
            raise Unreachable(f"cannot reach {self.shown}: {reason}") from None
        try:
            envelope = json.loads(body)
        except ValueError:
            raise QueryFailed(f"{self.shown}{path} did not answer JSON: is it a Prometheus query API?") from None
        if not isinstance(envelope, dict) or envelope.get("status") != "success":
            error = envelope.get("error") if isinstance(envelope, dict) else None
            raise QueryFailed(f"{self.shown}{path}: {error or 'not a Prometheus API answer'}")
        return envelope.get("data")

    def _http_error(self, exc: urllib.error.HTTPError) -> str:
        try:
            detail = json.loads(exc.read(_SECRET_MAX)).get("error", "")
        except (ValueError, AttributeError, OSError):
            detail = ""
        if exc.code in (401, 403) and self._basic and self.auth.kind == "none":
            return f"{self.shown}: HTTP {exc.code}: the user name and password in the URL were refused"
        if exc.code in (401, 403):
            hint = {"none": "the server wants credentials: --bearer-token-file or --auth azure",
                    "bearer": "the bearer token was refused",
                    "azure": "the Entra ID token was refused (does the identity hold Monitoring Data Reader "
                             "on the workspace?)"}[self.auth.kind]
            return f"{self.shown}: HTTP {exc.code}: {hint}"
        return f"{self.shown}: HTTP {exc.code} {exc.reason}{': ' + detail if detail else ''}"

    def query(self, expr: str) -> list[Sample]:
        """An instant query's vector (a scalar comes back as one sample without labels)."""
        data = self._request("/api/v1/query", {"query": expr})
        kind, result = data.get("resultType"), data.get("result")
        if kind == "vector":
            return [Sample(dict(item.get("metric", {})), _number(item["value"][1])) for item in result]
        if kind == "scalar":
            return [Sample({}, _number(result[1]))]
        raise QueryFailed(f"expected a vector from {expr!r}, got {kind}")

    def recording_rules(self) -> set[str] | None:
        """Names of the recording rules the server evaluates, or None where it offers no rules API
        (an Azure Monitor workspace keeps its rule groups in Azure Resource Manager)."""
        try:
            data = self._request("/api/v1/rules?type=record")
        except Unreachable:
            raise
        except QueryFailed:
            return None
        return {rule["name"] for group in data.get("groups", []) for rule in group.get("rules", [])
                if rule.get("type") == "recording"}


def _number(text: Any) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan
