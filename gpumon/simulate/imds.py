"""A loopback Azure IMDS: compute metadata and Scheduled Events, as documented (Azure's
instance-metadata-service and scheduled-events pages: the ``Metadata: true`` header, the compute
document's keys, ``DocumentIncarnation``, ``Events`` with RFC 1123 ``NotBefore``, acknowledgement by
POST ``{"StartRequests": [...]}``). A simulated host serves its identity and events through it, and the
tests drive gpumon's one IMDS client against it.

Plain HTTP on 127.0.0.1 (IMDS is plain HTTP). Requests without ``Metadata: true`` get 400, as IMDS
answers them. Each path can be made to fail (``fail(path, status)``), answer slowly (``hold(path)``
until ``release()``), answer with broken JSON (``fail(path, "malformed")``) or with any bytes
(``fail(path, b"...")``: a hostile IMDS), or trickle its answer a byte at a time (``trickle(path)``). Acknowledgements
(POST ``{"StartRequests": [{"EventId": ...}]}``) are checked and recorded in ``acks``.
"""

from __future__ import annotations

import email.utils
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

COMPUTE = {
    "azEnvironment": "AzurePublicCloud", "location": "eastus2", "name": "gpu-node-0_3",
    "vmId": "6c1f3c4e-0000-4000-8000-000000000001", "vmSize": "Standard_ND96isr_H100_v5", "zone": "2",
    "vmScaleSetName": "gpu-node", "placementGroupId": "0fe3c7b1-4f5e-4b9f-a3a8-6ad3f3ad0d1a",
    "platformFaultDomain": "1", "platformUpdateDomain": "0",
    "subscriptionId": "8d2b4e6a-1111-4222-8333-444455556666", "resourceGroupName": "rg-train",
    "resourceId": "/subscriptions/8d2b4e6a-1111-4222-8333-444455556666/resourceGroups/rg-train/providers/"
                  "Microsoft.Compute/virtualMachineScaleSets/gpu-node/virtualMachines/3",
    "tagsList": [],
}
COMPUTE_PATH = "/metadata/instance/compute"
EVENTS_PATH = "/metadata/scheduledevents"


def rfc1123(when: float) -> str:
    """NotBefore as IMDS writes it: ``Mon, 19 Sep 2016 18:29:47 GMT``."""
    return email.utils.formatdate(when, usegmt=True)


def scheduled_event(event_id: str, event_type: str = "Reboot", status: str = "Scheduled",
                    not_before: str = "Mon, 19 Sep 2016 18:29:47 GMT", source: str = "Platform",
                    duration: int = -1, resources: tuple[str, ...] = ("gpu-node-0_3",),
                    description: str = "Host server is undergoing maintenance.") -> dict[str, Any]:
    return {"EventId": event_id, "EventStatus": status, "EventType": event_type,
            "ResourceType": "VirtualMachine", "Resources": list(resources), "NotBefore": not_before,
            "Description": description, "EventSource": source, "DurationInSeconds": duration}


class ImdsServer:
    def __init__(self, compute: dict[str, Any] | None = None) -> None:
        self.compute = dict(COMPUTE if compute is None else compute)
        self.incarnation = 1
        self.events: list[dict[str, Any]] = []
        self.acks: list[str] = []
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self._faults: dict[str, int | str | bytes] = {}
        self._trickle: dict[str, float] = {}
        self._held: set[str] = set()
        self._release = threading.Event()
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                server._handle(self, "GET")

            def do_POST(self) -> None:  # noqa: N802
                server._handle(self, "POST")

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                         name="imds-stand-in", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- what the test changes -----------------------------------------------------------------

    def set_events(self, *events: dict[str, Any]) -> None:
        """Replace the document's events; the incarnation goes up as IMDS's does on any change."""
        with self._lock:
            self.events = [dict(e) for e in events]
            self.incarnation += 1

    def fail(self, path: str, how: int | str | bytes | None) -> None:
        """Answer ``path`` with HTTP status ``how``, ``"malformed"`` JSON, or these bytes as a 200's
        body; None heals it."""
        with self._lock:
            if how is None:
                self._faults.pop(path, None)
            else:
                self._faults[path] = how

    def trickle(self, path: str, every: float | None = 0.1) -> None:
        """Answer ``path`` one byte every ``every`` seconds (None heals it): each read gets something,
        so only a deadline on the whole request ends it."""
        with self._lock:
            if every is None:
                self._trickle.pop(path, None)
            else:
                self._trickle[path] = every

    def hold(self, path: str) -> None:
        """Answer ``path`` only after ``release()`` (a slow IMDS)."""
        with self._lock:
            self._held.add(path)
            self._release.clear()

    def release(self) -> None:
        with self._lock:
            self._held.clear()
        self._release.set()

    def count(self, path: str, method: str = "GET") -> int:
        with self._lock:
            return sum(1 for m, p, _ in self.requests if p == path and m == method)

    # -- the server ----------------------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        path = urllib.parse.urlsplit(h.path).path
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0)) if method == "POST" else b""
        with self._lock:
            self.requests.append((method, path, dict(h.headers)))
            held, fault, trickle = path in self._held, self._faults.get(path), self._trickle.get(path)
        if held:
            self._release.wait(30)
        if trickle is not None:
            return self._send_slowly(h, trickle)
        if h.headers.get("Metadata", "").lower() != "true":
            return self._send(h, 400, {"error": "bad_request",
                                       "error_description": "Required metadata header not specified"})
        if isinstance(fault, bytes):
            return self._send_raw(h, 200, fault)
        if fault == "malformed":
            return self._send_raw(h, 200, b'{"DocumentIncarnation": 3, "Events": [')
        if isinstance(fault, int):
            return self._send(h, fault, {"error": f"status {fault}"})
        if path == COMPUTE_PATH and method == "GET":
            return self._send(h, 200, self.compute)
        if path == EVENTS_PATH and method == "GET":
            with self._lock:
                doc = {"DocumentIncarnation": self.incarnation, "Events": [dict(e) for e in self.events]}
            return self._send(h, 200, doc)
        if path == EVENTS_PATH and method == "POST":
            return self._acknowledge(h, body)
        self._send(h, 404, {"error": "not_found"})

    def _acknowledge(self, h: BaseHTTPRequestHandler, body: bytes) -> None:
        try:
            requests = json.loads(body)["StartRequests"]
            ids = [r["EventId"] for r in requests]
            if not ids or not all(isinstance(i, str) for i in ids):
                raise ValueError("no event ids")
        except (ValueError, KeyError, TypeError):
            return self._send(h, 400, {"error": "malformed StartRequests"})
        with self._lock:
            self.acks.extend(ids)
        self._send_raw(h, 200, b"")

    def _send_slowly(self, h: BaseHTTPRequestHandler, every: float) -> None:
        answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + b"X-Padding: " + b"x" * 10_000
        for i in range(len(answer)):
            if self._release.wait(every):
                return
            try:
                h.wfile.write(answer[i:i + 1])
                h.wfile.flush()
            except OSError:
                return  # the client gave up

    def _send(self, h: BaseHTTPRequestHandler, status: int, doc: Any) -> None:
        self._send_raw(h, status, json.dumps(doc).encode())

    @staticmethod
    def _send_raw(h: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
        h.send_response(status)
        h.send_header("Content-Type", "application/json; charset=utf-8")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def close(self) -> None:
        self.release()
        self._httpd.shutdown()
        self._httpd.server_close()
