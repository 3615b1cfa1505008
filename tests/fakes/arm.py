"""A loopback Azure Resource Manager answering the Impact Reporting API's WorkloadImpacts_Create, over
real HTTPS (a trustme CA), validating every request against the published spec.

Schema facts, from Azure/azure-rest-api-specs
``specification/impact/resource-manager/Microsoft.Impact/preview/2023-12-01-preview/impact.json``
(operation ``WorkloadImpacts_Create``, definitions ``WorkloadImpact`` / ``WorkloadImpactProperties``)
and its TypeSpec source ``Impact/workloadImpacts.tsp``:
- ``PUT /subscriptions/{subscriptionId}/providers/Microsoft.Impact/workloadImpacts/{workloadImpactName}
  ?api-version=2023-12-01-preview``; the name matches ``^[a-zA-Z0-9][a-zA-Z0-9-:]*[a-zA-Z0-9]{3,120}$``;
- body ``{"properties": WorkloadImpactProperties}``; required ``startDateTime`` (date-time),
  ``impactedResourceId`` and ``impactCategory`` (strings); optional ``endDateTime``, ``impactDescription``,
  ``armCorrelationIds`` (string[]), ``performance``, ``connectivity``, ``additionalProperties`` (object),
  ``errorDetails``, ``workload``, ``impactGroupId``, ``confidenceLevel`` (Low, Medium, High),
  ``clientIncidentDetails``; read-only (never sent): ``impactUniqueId``, ``reportedTimeUtc``,
  ``provisioningState``. (``ongoingImpact``, ``severity``, ``hitCount`` and the like came with
  2025-01-01-preview and are not part of this version.)
- answers 200 (updated) or 201 (created) with the resource; errors in ARM's shape
  ``{"error": {"code", "message", "target", "details": [...]}}``.
The service also checks ``impactCategory`` against its ``/impactCategories`` list (ImpactCategories_Get):
``categories`` here stands for that list.
"""

from __future__ import annotations

import datetime
import functools
import http.server
import json
import re
import ssl
import threading
import time
import urllib.parse
from typing import Any

import trustme

from tests.fakes.tokens import token_audience

API_VERSION = "2023-12-01-preview"
NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9-:]*[a-zA-Z0-9]{3,120}$")
PATH = re.compile(r"^/subscriptions/(?P<sub>[^/]+)/providers/Microsoft\.Impact/workloadImpacts/(?P<name>[^/]+)$")
AUDIENCE = "https://management.azure.com"
READ_ONLY = ("impactUniqueId", "reportedTimeUtc", "provisioningState")

PROPERTIES = {
    "type": "object",
    "required": ["startDateTime", "impactedResourceId", "impactCategory"],
    "additionalProperties": False,  # a field of another api-version (or a typo) is a mistake of ours
    "properties": {
        "startDateTime": {"type": "string", "format": "date-time"},
        "endDateTime": {"type": ["string", "null"], "format": "date-time"},
        "impactedResourceId": {"type": "string", "minLength": 1},
        "impactCategory": {"type": "string", "minLength": 1},
        "impactDescription": {"type": "string"},
        "armCorrelationIds": {"type": "array", "items": {"type": "string"}},
        "performance": {"type": "array", "items": {"type": "object"}},
        "connectivity": {"type": "object"},
        "additionalProperties": {"type": "object"},
        "errorDetails": {"type": "object"},
        "workload": {"type": "object"},
        "impactGroupId": {"type": "string"},
        "confidenceLevel": {"enum": ["Low", "Medium", "High"]},
        "clientIncidentDetails": {"type": "object"},
    },
}
SCHEMA = {"type": "object", "required": ["properties"], "properties": {"properties": PROPERTIES}}


def _date_time(value: object) -> bool:
    if not isinstance(value, str) or not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)",
                                                       value):
        return False
    datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    return True


@functools.cache
def _validator() -> Any:
    """The request schema's validator, made when the first server starts: importing jsonschema takes
    seconds (it compiles its format grammars), which every test process that merely collects this
    module would pay."""
    import jsonschema

    formats = jsonschema.FormatChecker(formats=())
    formats.checks("date-time", raises=ValueError)(_date_time)
    return jsonschema.Draft7Validator(SCHEMA, format_checker=formats)


def arm_error(status: int, code: str, message: str, target: str = "",
              details: list[dict[str, str]] | None = None) -> tuple[int, dict[str, Any], dict[str, str]]:
    error: dict[str, Any] = {"code": code, "message": message}
    if target:
        error["target"] = target
    if details:
        error["details"] = details
    return status, {"error": error}, {}


class ArmImpactServer:
    """``faults``: a queue of answers given before any validation, one per request: ``(status,
    headers)`` or ``"hang"`` (no answer until ``release`` is set or 30 s pass). ``block``: hold every
    request until it is set (a report in flight)."""

    def __init__(self, categories: set[str] | None = None) -> None:
        _validator()  # made here, not while a client waits on the first request
        self.ca = trustme.CA()
        self.categories = categories
        self.faults: list[Any] = []
        self.requests: list[dict[str, Any]] = []
        self.impacts: dict[str, dict[str, Any]] = {}
        self.release = threading.Event()
        self.block = threading.Event()
        self.block.set()
        self._lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_PUT(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                status, doc, headers = server.handle(self.command, self.path, {k.lower(): v for k, v in self.headers.items()},
                                                     raw)
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = do_PUT  # noqa: N815 - answered 405 by handle

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ca.issue_cert("127.0.0.1").configure_cert(context)
        self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def ca_file(self, path: str) -> str:
        self.ca.cert_pem.write_to_path(path)
        return path

    def close(self) -> None:
        self.release.set()
        self.block.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def puts(self) -> list[dict[str, Any]]:
        with self._lock:
            return [r for r in self.requests if r["method"] == "PUT"]

    # -- one request ---------------------------------------------------------------------------------
    def handle(self, method: str, path: str, headers: dict[str, str], raw: bytes
               ) -> tuple[int, dict[str, Any], dict[str, str]]:
        with self._lock:
            self.requests.append({"method": method, "path": path, "headers": headers, "raw": raw,
                                  "time": time.monotonic()})
            fault = self.faults.pop(0) if self.faults else None
        self.block.wait(30)
        if fault == "hang":
            self.release.wait(30)
            return arm_error(504, "GatewayTimeout", "the client gave up long ago")
        if fault is not None:
            status, extra = fault
            codes = {401: "InvalidAuthenticationToken", 403: "AuthorizationFailed", 409: "Conflict",
                     429: "TooManyRequests", 500: "InternalServerError"}
            message = {403: "The client does not have authorization to perform action "
                            "'Microsoft.Impact/workloadImpacts/write' over scope '/subscriptions/x'"}
            return (*arm_error(status, codes.get(status, "Error"), message.get(status, f"injected {status}"))[:2],
                    dict(extra))
        return self._create(method, path, headers, raw)

    def _create(self, method: str, path: str, headers: dict[str, str], raw: bytes
                ) -> tuple[int, dict[str, Any], dict[str, str]]:
        url = urllib.parse.urlsplit(path)
        match = PATH.match(url.path)
        if method != "PUT" or match is None:
            return arm_error(405, "MethodNotAllowed", f"{method} {url.path} is not served here")
        query = urllib.parse.parse_qs(url.query)
        if query.get("api-version") != [API_VERSION]:
            return arm_error(400, "InvalidApiVersionParameter", f"api-version {query.get('api-version')}")
        auth = headers.get("authorization", "")
        seen = token_audience(auth.removeprefix("Bearer ")) if auth.startswith("Bearer ") else None
        if seen is None or seen[0].rstrip("/") != AUDIENCE or seen[1] < time.time():
            return arm_error(401, "InvalidAuthenticationToken", f"token for {seen} is not for {AUDIENCE}")
        if not NAME.match(match["name"]):
            return arm_error(400, "InvalidResourceName", "name does not match the pattern", "workloadImpactName")
        if headers.get("content-type", "").split(";")[0] != "application/json":
            return arm_error(415, "UnsupportedMediaType", headers.get("content-type", ""))
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            return arm_error(400, "InvalidRequestContent", f"not JSON: {exc}")
        errors = sorted(_validator().iter_errors(doc),
                        key=lambda e: list(e.absolute_path))
        props = doc.get("properties") if isinstance(doc, dict) else None
        for field in READ_ONLY:
            if isinstance(props, dict) and field in props:
                return arm_error(400, "InvalidRequestContent", "read-only", f"properties.{field}")
        if errors:
            return arm_error(400, "InvalidRequestContent", "The request content was invalid.", "",
                             [{"code": "ValidationError", "target": ".".join(map(str, e.absolute_path)) or "body",
                               "message": e.message} for e in errors])
        assert isinstance(props, dict)
        if self.categories is not None and props["impactCategory"] not in self.categories:
            return arm_error(400, "InvalidImpactCategory", "unknown impact category", "",
                             [{"code": "InvalidImpactCategory", "target": "properties.impactCategory",
                               "message": f"{props['impactCategory']} is not a known impact category"}])
        name = match["name"]
        with self._lock:
            created = name not in self.impacts
            self.impacts[name] = doc
        resource = {"id": url.path, "name": name, "type": "Microsoft.Impact/workloadImpacts",
                    "properties": {**props, "provisioningState": "Succeeded",
                                   "reportedTimeUtc": datetime.datetime.now(datetime.timezone.utc).isoformat()}}
        return (201 if created else 200), resource, {}
