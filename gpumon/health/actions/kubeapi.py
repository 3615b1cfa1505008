"""The one Kubernetes API client the health actions share: bearer token re-read on every request
(the kubelet rotates projected tokens), the cluster CA, JSON in and out, errors as
:class:`ActionError` with the HTTP status kept so a caller can tell a 404 or a 409 from a failure."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from gpumon.health.actions.process import ActionError
from gpumon.health.actions.settings import ActionSettings
from gpumon.sinks.common import retry_after_from_headers

STRATEGIC_MERGE = "application/strategic-merge-patch+json"


class KubeApiError(ActionError):
    """An answer other than 2xx; ``code`` is its HTTP status (0: no answer at all)."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class KubeApi:
    def __init__(self, settings: ActionSettings) -> None:
        self.node = settings.kube_node_name()
        self.url = settings.kube_api_url()
        self.token_file = settings.kube_token_file
        self.ca_file = settings.kube_ca_file
        self.timeout = settings.timeout

    def ready(self) -> None:
        if not self.node or not self.url:
            raise ActionError("no node name (NODE_NAME) or API server address (KUBERNETES_SERVICE_HOST)")

    def node_path(self, suffix: str = "") -> str:
        return f"/api/v1/nodes/{urllib.parse.quote(self.node, safe='')}{suffix}"

    def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        """One request; the decoded JSON answer."""
        url = self.url + path
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json", "User-Agent": "gpumon", "Authorization": f"Bearer {self._token()}"}
        if data is not None:
            headers["Content-Type"] = content_type
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self._tls()) as resp:
                text = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read(512).decode("utf-8", "replace").strip()
            wait = retry_after_from_headers(exc.headers)
            raise KubeApiError(f"{method} {url}: HTTP {exc.code} {detail}"
                               + (f" (retry after {wait:g} s)" if wait is not None else ""), exc.code) from None
        except (OSError, ValueError) as exc:  # URLError, timeouts, TLS failures, a malformed URL
            raise KubeApiError(f"{method} {url}: {getattr(exc, 'reason', None) or exc}") from None
        try:
            return json.loads(text) if text else None
        except ValueError:
            raise KubeApiError(f"{method} {url}: the answer is not JSON") from None

    def _token(self) -> str:
        try:
            with open(self.token_file, encoding="utf-8") as fh:
                return fh.read().strip()
        except OSError as exc:
            raise ActionError(f"cannot read the service-account token {self.token_file}: {exc.strerror}") from None

    def _tls(self) -> ssl.SSLContext:
        try:
            return ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ActionError(f"cannot load the cluster CA {self.ca_file}: {exc}") from None
