"""A loopback stand-in for Azure Monitor Logs Ingestion (HTTPS, throwaway CA) and for the VM's IMDS.

``IngestionServer`` implements the contract the sink relies on:
``POST /dataCollectionRules/{immutableId}/streams/{stream}?api-version=...`` with a bearer token for
``https://monitor.azure.com``, an optionally gzipped JSON array of at most 1 MB, every row checked
against the ``streamDeclarations`` *read from the shipped template* ``deploy/azure/azuredeploy.json``;
204 on success. Faults are queued with :meth:`IngestionServer.fail` (429 with Retry-After, 500/503,
413, 403, a hung response) or made with :meth:`IngestionServer.refuse` (connection refused).

Tokens come from :mod:`tests.fakes.tokens`; the VM's IMDS (compute, events, managed-identity tokens)
is :class:`tests.fakes.imds.ImdsServer`.

Run as a script it serves until killed and prints one JSON line with its addresses (for tests that
drive a ``gpumon`` subprocess).
"""

from __future__ import annotations

import datetime as dt
import gzip
import json
import os
import re
import socket
import ssl
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.fakes.imds import ImdsServer
from tests.fakes.tokens import token_audience

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEMPLATE = os.path.join(ROOT, "deploy", "azure", "azuredeploy.json")
AUDIENCE = "https://monitor.azure.com"
MAX_BODY = 1024 * 1024
DCR_ID = "dcr-00000000000000000000000000000001"
_PATH_RE = re.compile(r"^/dataCollectionRules/([^/]+)/streams/([^/?]+)$")


def load_declarations(path: str = TEMPLATE) -> dict[str, dict[str, str]]:
    """stream name -> {column: type} from the template's DCR."""
    with open(path, encoding="utf-8") as fh:
        template = json.load(fh)
    for resource in template["resources"]:
        if resource["type"] == "Microsoft.Insights/dataCollectionRules":
            decls = resource["properties"]["streamDeclarations"]
            return {name: {c["name"]: c["type"] for c in d["columns"]} for name, d in decls.items()}
    raise ValueError(f"{path} declares no data collection rule")


def _valid(kind: str, value: Any) -> bool:
    if value is None:
        return True
    if kind == "string":
        return isinstance(value, str)
    if kind in ("int", "long"):
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "real":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "datetime":
        if not isinstance(value, str):
            return False
        try:
            dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return False
        return True
    return kind == "dynamic"


def validate_row(row: Any, columns: dict[str, str]) -> str | None:
    """None if the row fits the declaration, else the reason (as the service would say it)."""
    if not isinstance(row, dict):
        return "record is not a JSON object"
    for key, value in row.items():
        kind = columns.get(key)
        if kind is None:
            return f"column {key!r} is not declared in the stream"
        if not _valid(kind, value):
            return f"column {key!r}: {value!r} is not a valid {kind}"
    if "TimeGenerated" in columns and not row.get("TimeGenerated"):
        return "TimeGenerated is missing"
    return None


@dataclass
class Fault:
    status: int
    count: int = 1
    retry_after: float | None = None
    hang: bool = False
    stream: str | None = None


@dataclass
class Request:
    stream: str
    status: int
    rows: int
    wire_bytes: int
    json_bytes: int


@dataclass
class _State:
    rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    forbidden: bool = False
    reject: Callable[[dict[str, Any]], bool] | None = None
    hung: int = 0
    rejected: list[str] = field(default_factory=list)


class IngestionServer:
    """Start with ``with IngestionServer() as srv:``; ``srv.endpoint``, ``srv.ca_path``, ``srv.rows``."""

    def __init__(self, dcr_id: str = DCR_ID, template: str = TEMPLATE) -> None:
        import trustme

        self.dcr_id = dcr_id
        self.declarations = load_declarations(template)
        self._ca = trustme.CA()
        cert = self._ca.issue_cert("127.0.0.1", "localhost")
        self._tmp = tempfile.TemporaryDirectory(prefix="gpumon-ingest-")
        self.ca_path = os.path.join(self._tmp.name, "ca.pem")
        self._ca.cert_pem.write_to_path(self.ca_path)
        self._ssl = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        cert.configure_cert(self._ssl)
        self._cond = threading.Condition()
        self._state = _State()
        self._release = threading.Event()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self._bind()

    # -- lifecycle ------------------------------------------------------------------------------

    def _bind(self) -> None:
        server = self

        class Handler(_IngestHandler):
            owner = server

        httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler, bind_and_activate=False)
        httpd.allow_reuse_address = True
        httpd.daemon_threads = True
        httpd.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        httpd.server_bind()
        httpd.server_activate()
        httpd.socket = self._ssl.wrap_socket(httpd.socket, server_side=True, do_handshake_on_connect=False)
        self.port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="ingest-server", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def refuse(self) -> None:
        """Close the listening socket: connections are refused until :meth:`resume`."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def resume(self) -> None:
        if self._httpd is None:
            self._bind()

    def close(self) -> None:
        self._release.set()
        self.refuse()
        self._tmp.cleanup()

    def __enter__(self) -> IngestionServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- control --------------------------------------------------------------------------------

    def fail(self, status: int, count: int = 1, retry_after: float | None = None, stream: str | None = None,
             hang: bool = False) -> None:
        """Answer the next ``count`` requests (of ``stream``, or any) with ``status`` (or hang)."""
        with self._cond:
            self._state.faults.append(Fault(status, count, retry_after, hang, stream))

    def forbid(self, on: bool = True) -> None:
        """403 every request, as when the role assignment is missing."""
        with self._cond:
            self._state.forbidden = on

    def reject_rows(self, predicate: Callable[[dict[str, Any]], bool] | None) -> None:
        """400 any request holding a row for which ``predicate`` is true (one bad row fails the call)."""
        with self._cond:
            self._state.reject = predicate

    def release_hung(self) -> None:
        self._release.set()

    def rows(self, stream: str) -> list[dict[str, Any]]:
        with self._cond:
            return list(self._state.rows.get(stream, []))

    def hung_count(self) -> int:
        """Requests left hanging so far."""
        with self._cond:
            return self._state.hung

    def requests(self) -> list[Request]:
        with self._cond:
            return list(self._state.requests)

    def rejected(self) -> list[str]:
        with self._cond:
            return list(self._state.rejected)

    def wait_for(self, predicate: Callable[[IngestionServer], bool], timeout: float = 10.0) -> bool:
        """Block until ``predicate(self)`` holds (re-checked on every request) or ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._cond.release()
                try:
                    if predicate(self):
                        return True
                finally:
                    self._cond.acquire()
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.2))

    # -- request handling -----------------------------------------------------------------------

    def _take_fault(self, stream: str) -> Fault | None:
        with self._cond:
            for fault in self._state.faults:
                if fault.stream is None or fault.stream == stream:
                    fault.count -= 1
                    if fault.count <= 0:
                        self._state.faults.remove(fault)
                    return fault
        return None

    def _record(self, request: Request, rows: list[dict[str, Any]] | None, rejected: str | None) -> None:
        with self._cond:
            self._state.requests.append(request)
            if rows:
                self._state.rows.setdefault(request.stream, []).extend(rows)
            if rejected:
                self._state.rejected.append(rejected)
            self._cond.notify_all()


class _IngestHandler(BaseHTTPRequestHandler):
    owner: IngestionServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        pass

    def setup(self) -> None:
        self.request.settimeout(10)
        super().setup()

    def _reply(self, status: int, error: str = "", message: str = "", headers: dict[str, str] | None = None) -> None:
        body = b""
        if error:
            body = json.dumps({"error": {"code": error, "message": message}}).encode()
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if body:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        srv = self.owner
        url = urllib.parse.urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        match = _PATH_RE.match(url.path)
        stream = urllib.parse.unquote(match.group(2)) if match else "?"
        req = Request(stream, 0, 0, len(raw), 0)

        def done(status: int, error: str = "", message: str = "", headers: dict[str, str] | None = None,
                 rows: list[dict[str, Any]] | None = None) -> None:
            req.status = status
            # recorded before the answer goes out: a client that has its answer finds the request logged
            srv._record(req, rows, message if status == 400 else None)
            self._reply(status, error, message, headers)

        if not match:
            return done(404, "NotFound", f"no route {url.path}")
        if "api-version" not in urllib.parse.parse_qs(url.query):
            return done(400, "MissingApiVersionParameter", "api-version is required")
        auth = self.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            return done(401, "InvalidToken", "bearer token missing")
        claims = token_audience(auth[7:])
        if claims is None or claims[1] < time.time():
            return done(401, "InvalidToken", "token invalid or expired")
        if claims[0].rstrip("/") != AUDIENCE:
            return done(401, "InvalidAudience", f"token audience {claims[0]} is not {AUDIENCE}")
        if match.group(1) != srv.dcr_id:
            return done(404, "NotFound", f"data collection rule {match.group(1)} not found")
        columns = srv.declarations.get(stream)
        if columns is None:
            return done(404, "InvalidStream", f"stream {stream} is not declared in the DCR")
        if srv._state.forbidden:
            return done(403, "OperationFailed", "The authentication token provided does not have access "
                        "to ingest data for the data collection rule")
        fault = srv._take_fault(stream)
        if fault is not None:
            if fault.hang:
                with srv._cond:
                    srv._state.hung += 1
                    srv._cond.notify_all()
                srv._release.wait(30)
                return
            headers = {"Retry-After": f"{fault.retry_after:g}"} if fault.retry_after is not None else None
            return done(fault.status, "Injected", f"injected {fault.status}", headers)
        if self.headers.get("Content-Encoding", "").lower() == "gzip":
            try:
                raw = gzip.decompress(raw)
            except (OSError, EOFError):
                return done(400, "InvalidContentEncoding", "body is not gzip")
        req.json_bytes = len(raw)
        if len(raw) > MAX_BODY:
            return done(413, "ContentLengthLimitExceeded", f"{len(raw)} bytes is over {MAX_BODY}")
        try:
            rows = json.loads(raw)
        except ValueError as exc:
            return done(400, "InvalidJson", f"body is not JSON: {exc}")
        if not isinstance(rows, list):
            return done(400, "InvalidJson", "body must be a JSON array")
        reject = srv._state.reject
        for index, row in enumerate(rows):
            problem = validate_row(row, columns)
            if problem is None and reject is not None and reject(row):
                problem = "record rejected by the transformation"
            if problem:
                return done(400, "InvalidRecord", f"record {index}: {problem}")
        req.rows = len(rows)
        return done(204, rows=rows)


class UndeclaredStreamIs400(_IngestHandler):
    """Answers a stream the DCR does not declare with 400 InvalidStream, a request-level 400."""

    def _reply(self, status, error="", message="", headers=None):
        super()._reply(400 if error == "InvalidStream" else status, error, message, headers)


def main() -> None:  # pragma: no cover - used by subprocess-driven tests and by hand
    srv = IngestionServer()
    imds = ImdsServer()
    print(json.dumps({"endpoint": srv.endpoint, "ca": srv.ca_path, "dcr": srv.dcr_id, "imds": imds.url}),
          flush=True)
    threading.Event().wait()


if __name__ == "__main__":  # pragma: no cover
    main()
