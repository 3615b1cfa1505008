"""The VM's IMDS for the tests: the simulated host's stand-in (:mod:`gpumon.simulate.imds`: compute
metadata, Scheduled Events, faults) plus the managed-identity token endpoint, so the real
azure-identity ``ManagedIdentityCredential`` runs when ``AZURE_POD_IDENTITY_AUTHORITY_HOST`` points
at :attr:`ImdsServer.url`.

The token endpoint as Azure documents it ("How to use managed identities for Azure resources on an
Azure VM to acquire an access token"): ``GET /metadata/identity/oauth2/token?api-version=...&resource=...``
with ``Metadata: true``, ``client_id`` naming a user-assigned identity; the answer carries
``access_token``, ``expires_in``, ``expires_on``, ``resource`` and ``token_type``; an identity the VM
does not have is 400 ``invalid_request`` "Identity not found".
"""

from __future__ import annotations

import urllib.parse
from http.server import BaseHTTPRequestHandler
from typing import Any

from gpumon.simulate import imds as simulated
from gpumon.simulate.imds import COMPUTE, COMPUTE_PATH, EVENTS_PATH, rfc1123, scheduled_event
from tests.fakes.tokens import mint_token

__all__ = ["COMPUTE", "COMPUTE_PATH", "EVENTS_PATH", "TOKEN_PATH", "ImdsServer", "rfc1123", "scheduled_event"]

TOKEN_PATH = "/metadata/identity/oauth2/token"


class ImdsServer(simulated.ImdsServer):
    """Compute, Scheduled Events and managed-identity tokens on one loopback IMDS.

    ``client_ids``: the user-assigned identities the VM has (any ``client_id`` not among them is
    refused); ``identity = False``: the VM has no identity at all; ``audience_override``: tokens name
    this audience instead of the requested resource (a misconfigured scope); ``token_requests``
    counts the token requests."""

    def __init__(self, compute: dict[str, Any] | None = None, client_ids: tuple[str, ...] = ()) -> None:
        self.client_ids = set(client_ids)
        self.identity = True
        self.audience_override: str | None = None
        self.token_requests = 0
        super().__init__(compute)

    @property
    def compute_url(self) -> str:
        return f"{self.url}{COMPUTE_PATH}?api-version=2021-02-01"

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        url = urllib.parse.urlsplit(h.path)
        if url.path != TOKEN_PATH or method != "GET":
            return super()._handle(h, method)
        if h.headers.get("Metadata", "").lower() != "true":
            return self._send(h, 400, {"error": "bad_request",
                                       "error_description": "Required metadata header not specified"})
        query = dict(urllib.parse.parse_qsl(url.query))
        with self._lock:
            self.token_requests += 1
        client_id = query.get("client_id")
        if not self.identity or (client_id and client_id not in self.client_ids):
            return self._send(h, 400, {"error": "invalid_request", "error_description": "Identity not found"})
        resource = query.get("resource", "")
        token, expires = mint_token(self.audience_override or resource)
        self._send(h, 200, {"access_token": token, "expires_in": "3600", "expires_on": str(expires),
                            "resource": resource, "token_type": "Bearer"})
