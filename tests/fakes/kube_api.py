"""A loopback HTTPS stand-in for the Kubernetes API server, for what the health actions send:
``PATCH /api/v1/nodes/<name>/status`` (NodeConditions), ``GET`` and ``PATCH /api/v1/nodes/<name>``
(taints), ``POST /api/v1/namespaces/default/events`` and ``PATCH .../events/<name>`` (Events).

What it checks, as the real one would: the bearer token (401), the content type (415: a PATCH must
be strategic-merge-patch, a POST JSON), the body and the patched object against the Kubernetes
OpenAPI schema in its strict form (422; kubernetes-validate's schemas, run by the tools venv's
Python so no JSON-schema library is needed here), NodeCondition status values, RFC 3339 times, an
Event's namespace, involved object, type and source, and a Node patch's ``resourceVersion`` (409
Conflict when stale). Strategic-merge semantics as the Node's schema declares them:
``status.conditions`` merge by ``type``; ``spec.taints`` has no merge key and is replaced whole.
Faults for the tests: ``forbidden`` (403) and ``hang`` (no answer until released).
"""

from __future__ import annotations

import copy
import datetime
import http.server
import json
import os
import ssl
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import trustme

from tests.support.kubernetes import tool

K8S_VERSION = "1.33.0"
PATCH_TYPE = "application/strategic-merge-patch+json"
_VALIDATOR = r"""
import json, sys
import kubernetes_validate
for line in sys.stdin:
    try:
        kubernetes_validate.validate(json.loads(line), sys.argv[1], strict=True)
        print("ok", flush=True)
    except Exception as exc:
        print(" ".join(str(getattr(exc, "message", exc)).split())[:500] or type(exc).__name__, flush=True)
"""


class SchemaValidator:
    """kubernetes-validate in a co-process: one JSON document per line in, "ok" or the error out."""

    def __init__(self, version: str = K8S_VERSION) -> None:
        python = os.path.join(os.path.dirname(tool("kubernetes-validate")), "python")
        self._proc = subprocess.Popen([python, "-c", _VALIDATOR, version], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        self._lock = threading.Lock()

    def errors(self, doc: dict[str, Any]) -> str:
        with self._lock:
            assert self._proc.stdin and self._proc.stdout
            self._proc.stdin.write(json.dumps(doc) + "\n")
            self._proc.stdin.flush()
            answer = self._proc.stdout.readline().strip()
        return "" if answer == "ok" else answer or "validator exited"

    def close(self) -> None:
        if self._proc.stdin:
            self._proc.stdin.close()
        self._proc.wait(10)


def _rfc3339(value: Any) -> bool:
    try:
        return isinstance(value, str) and value.endswith("Z") and bool(
            datetime.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        return False


def merge_conditions(current: list[dict], patch: list[dict]) -> list[dict]:
    """Strategic merge of a list whose patchMergeKey is ``type``: each patched entry's fields replace
    those of the entry with its type, new types are appended, the others are kept."""
    out = [dict(c) for c in current]
    for entry in patch:
        same = next((c for c in out if c.get("type") == entry.get("type")), None)
        if same is None:
            out.append(dict(entry))
        else:
            same.update(entry)
    return out


class KubeApiServer:
    def __init__(self, node: str, token: str) -> None:
        self.ca = trustme.CA()
        self.token = token
        self.fault: str | None = None
        self.requests: list[dict[str, Any]] = []
        self.release = threading.Event()
        self.validator = SchemaValidator()
        self.events: dict[str, dict] = {}
        self.nodes = {node: {"apiVersion": "v1", "kind": "Node",
                             "metadata": {"name": node, "uid": "5e1c3a52-8d0e-4f6b-9d1e-2b7c4e0f9a11",
                                          "resourceVersion": "1"},
                             # the GPU operator's taint on a GPU node pool (AKS's --node-taints), kept
                             "spec": {"taints": [{"key": "sku", "value": "gpu", "effect": "NoSchedule"}]},
                             "status": {
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "kubelet is posting ready status",
                            "lastHeartbeatTime": "2025-01-01T00:00:00Z",
                            "lastTransitionTime": "2025-01-01T00:00:00Z"}]}}}
        self._lock = threading.Lock()
        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ca.issue_cert("127.0.0.1").configure_cert(context)
        self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def conditions(self, node: str) -> dict[str, dict]:
        with self._lock:
            return {c["type"]: dict(c) for c in self.nodes[node]["status"]["conditions"]}

    def taints(self, node: str) -> list[dict]:
        with self._lock:
            return copy.deepcopy(self.nodes[node]["spec"].get("taints") or [])

    def touch(self, node: str) -> None:
        """Another writer changed the Node (a kubelet status update): its resourceVersion moves on."""
        with self._lock:
            meta = self.nodes[node]["metadata"]
            meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)

    def close(self) -> None:
        self.release.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self.validator.close()

    # -- one request -------------------------------------------------------------------------------
    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict]:
        self.requests.append({"method": method, "path": path, "headers": headers, "body": body})
        if headers.get("authorization") != f"Bearer {self.token}":
            return 401, status(401, "Unauthorized")
        if self.fault == "forbidden":
            return 403, status(403, 'nodes "x" is forbidden: User "system:serviceaccount:gpumon:gpumon" '
                                    'cannot patch resource "nodes/status"', "Forbidden")
        if self.fault == "hang":
            self.release.wait(30)
        parts = path.split("/")
        if parts[:5] == ["", "api", "v1", "namespaces", "default"] and len(parts) in (6, 7) and parts[5] == "events":
            return self._events(method, parts[6] if len(parts) == 7 else None, headers, body)
        if len(parts) not in (5, 6) or parts[:4] != ["", "api", "v1", "nodes"] or parts[5:] not in ([], ["status"]):
            return 405, status(405, f"{method} {path} is not served here")
        if parts[4] not in self.nodes:
            return 404, status(404, f'nodes "{parts[4]}" not found', "NotFound")
        if method == "GET" and len(parts) == 5:
            with self._lock:
                return 200, copy.deepcopy(self.nodes[parts[4]])
        if method != "PATCH":
            return 405, status(405, f"{method} {path} is not served here")
        if headers.get("content-type") != PATCH_TYPE:
            return 415, status(415, f"content type {headers.get('content-type')} not served here")
        try:
            patch = json.loads(body)
        except ValueError as exc:
            return 400, status(400, f"invalid JSON: {exc}", "BadRequest")
        return self._apply(parts[4], patch) if len(parts) == 6 else self._apply_node(parts[4], patch)

    def _apply_node(self, name: str, patch: Any) -> tuple[int, dict]:
        """A strategic-merge PATCH of the Node itself: here, only its taints (what gpumon changes)."""
        if not isinstance(patch, dict) or not set(patch) <= {"metadata", "spec"} or "spec" not in patch:
            return 422, status(422, f"unexpected fields in a Node patch: {sorted(patch)}", "Invalid")
        meta = patch.get("metadata") or {}
        if not set(meta) <= {"resourceVersion"} or not set(patch["spec"]) <= {"taints"}:
            return 422, status(422, "only spec.taints (and metadata.resourceVersion) may change here", "Invalid")
        with self._lock:
            node = copy.deepcopy(self.nodes[name])
            if "resourceVersion" in meta and meta["resourceVersion"] != node["metadata"]["resourceVersion"]:
                return 409, status(409, f'Operation cannot be fulfilled on nodes "{name}": the object has been '
                                        "modified; please apply your changes to the latest version and try again",
                                   "Conflict")
            node["spec"]["taints"] = patch["spec"]["taints"]  # no patchMergeKey: the list is replaced
            problems = self.validator.errors(node)
            for t in node["spec"]["taints"] or []:
                if t.get("effect") not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
                    problems += f" taint {t.get('key')}: effect {t.get('effect')!r}"
            keys = [(t.get("key"), t.get("effect")) for t in node["spec"]["taints"] or []]
            if len(keys) != len(set(keys)):
                problems += " taints: duplicate key and effect"
            if problems:
                return 422, status(422, problems, "Invalid")
            node["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
            self.nodes[name] = node
            return 200, copy.deepcopy(node)

    def _events(self, method: str, name: str | None, headers: dict[str, str], body: bytes) -> tuple[int, dict]:
        want = {"POST": "application/json", "PATCH": PATCH_TYPE}.get(method)
        if want is None or (method == "POST") != (name is None):
            return 405, status(405, f"{method} on events is not served here")
        if headers.get("content-type") != want:
            return 415, status(415, f"content type {headers.get('content-type')} not served here")
        try:
            doc = json.loads(body)
        except ValueError as exc:
            return 400, status(400, f"invalid JSON: {exc}", "BadRequest")
        if not isinstance(doc, dict):
            return 400, status(400, "not an object", "BadRequest")
        with self._lock:
            if name is None:
                name = str((doc.get("metadata") or {}).get("name") or "")
                if not name:
                    return 422, status(422, "metadata.name: Required value", "Invalid")
                if name in self.events:
                    return 409, status(409, f'events "{name}" already exists', "AlreadyExists")
                event = doc
            elif name not in self.events:
                return 404, status(404, f'events "{name}" not found', "NotFound")
            else:
                event = {**copy.deepcopy(self.events[name]), **doc}  # scalar fields: replaced
            problems = self.validator.errors(event) + _event_problems(event)
            if problems:
                return 422, status(422, problems, "Invalid")
            self.events[name] = event
            return (201 if method == "POST" else 200), copy.deepcopy(event)

    def _apply(self, name: str, patch: Any) -> tuple[int, dict]:
        if not isinstance(patch, dict) or set(patch) != {"status"}:
            return 422, status(422, "only status may be patched through nodes/status", "Invalid")
        problems = self.validator.errors({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
                                          **patch})
        for c in patch["status"].get("conditions", []):
            if c.get("status") not in ("True", "False", "Unknown"):
                problems += f" condition {c.get('type')}: status {c.get('status')!r}"
            for field in ("lastHeartbeatTime", "lastTransitionTime"):
                if field in c and not _rfc3339(c[field]):
                    problems += f" condition {c.get('type')}: {field} {c[field]!r} is not RFC 3339"
        if problems:
            return 422, status(422, problems, "Invalid")
        with self._lock:
            node = copy.deepcopy(self.nodes[name])
            node["status"]["conditions"] = merge_conditions(node["status"]["conditions"],
                                                            patch["status"].get("conditions", []))
            merged_errors = self.validator.errors(node)
            if merged_errors:
                return 422, status(422, merged_errors, "Invalid")
            self.nodes[name] = node
            return 200, node

    def _handler(self):
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_PATCH(self) -> None:  # noqa: N802
                self._serve()

            def do_GET(self) -> None:  # noqa: N802
                self._serve()

            def do_POST(self) -> None:  # noqa: N802
                self._serve()

            def _serve(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                code, doc = server.handle(self.command, self.path, headers, body)
                payload = json.dumps(doc).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:
                    pass  # the client gave up (a hang test)

            def log_message(self, *args) -> None:
                pass

        return Handler


def _event_problems(event: dict) -> str:
    """What the API server's Event validation (pkg/apis/core/validation/events.go) refuses for a
    core/v1 Event about a Node."""
    problems = []
    if (event.get("metadata") or {}).get("namespace", "default") != "default":
        problems.append("metadata.namespace does not match the namespace of the request")
    obj = event.get("involvedObject") or {}
    if obj.get("kind") != "Node" or not obj.get("name") or not obj.get("uid") or obj.get("namespace"):
        problems.append(f"involvedObject: a Node by name and uid, without a namespace (got {obj})")
    if event.get("type") not in ("Normal", "Warning"):
        problems.append(f"type: Unsupported value {event.get('type')!r}")
    if not (event.get("source") or {}).get("component") and not event.get("reportingComponent"):
        problems.append("source.component: Required value")
    if not event.get("reason"):
        problems.append("reason: Required value")
    if not isinstance(event.get("count"), int) or event["count"] < 1:
        problems.append(f"count: {event.get('count')!r}")
    for field in ("firstTimestamp", "lastTimestamp"):
        if not _rfc3339(event.get(field)):
            problems.append(f"{field} {event.get(field)!r} is not RFC 3339")
    if _rfc3339(event.get("firstTimestamp")) and _rfc3339(event.get("lastTimestamp")) and \
            event["lastTimestamp"] < event["firstTimestamp"]:
        problems.append("lastTimestamp before firstTimestamp")
    return " ".join(problems)


def status(code: int, message: str, reason: str = "") -> dict:
    """A metav1.Status, as the API server answers errors."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


NODE = "aks-gpu-12345678-vmss000000"
"""The node name the Kubernetes action tests use (an AKS VMSS node's form)."""


def serving(tmp_path: Any) -> Iterator[KubeApiServer]:
    """A stand-in for ``NODE`` whose token and CA are written where :func:`action_settings` points;
    closed when the generator ends (the body of a pytest fixture)."""
    server = KubeApiServer(NODE, "token-1")
    (tmp_path / "token").write_text("token-1\n")
    server.ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    try:
        yield server
    finally:
        server.close()


def action_settings(tmp_path: Any, api: KubeApiServer, **flags: Any) -> Any:
    """ActionSettings that reach ``api`` as the in-cluster service account would, with ``flags``
    (``kubernetes=True``, ``kube_events=True``, ...)."""
    from gpumon.health.actions.settings import ActionSettings

    return ActionSettings(**{"node_name": NODE, "kube_api": api.url, "kube_token_file": str(tmp_path / "token"),
                             "kube_ca_file": str(tmp_path / "ca.crt"), "timeout": 5.0, "backoff_initial": 0.05,
                             "backoff_max": 0.2, **flags})
