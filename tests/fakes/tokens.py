"""Bearer tokens the stand-ins mint and check: self-describing (audience and expiry in the token) so
a stand-in server can answer 401 for a token minted for another audience, as Entra ID's resources do.
Minted by :class:`FakeCredential` (an azure-core ``TokenCredential``) and by the IMDS stand-in's
managed-identity endpoint; checked by the Logs Ingestion and ARM stand-ins."""

from __future__ import annotations

import base64
import json
import time
from typing import Any


def mint_token(audience: str, lifetime: float = 3600.0) -> tuple[str, int]:
    """A self-describing opaque token: the server checks its audience and expiry."""
    expires = int(time.time() + lifetime)
    body = base64.urlsafe_b64encode(json.dumps({"aud": audience, "exp": expires}).encode()).decode()
    return f"gpumontest.{body}", expires


def token_audience(token: str) -> tuple[str, int] | None:
    if not token.startswith("gpumontest."):
        return None
    try:
        doc = json.loads(base64.urlsafe_b64decode(token.split(".", 1)[1]))
        return str(doc["aud"]), int(doc["exp"])
    except (ValueError, KeyError, TypeError):
        return None


class FakeCredential:
    """A TokenCredential (``get_token``) minting tokens for whatever scope it is asked for."""

    def __init__(self, audience_override: str | None = None, fail: Exception | None = None) -> None:
        self.audience_override = audience_override
        self.fail = fail
        self.calls = 0

    def get_token(self, *scopes: str, **kwargs: Any) -> Any:
        from azure.core.credentials import AccessToken

        self.calls += 1
        if self.fail is not None:
            raise self.fail
        audience = self.audience_override or scopes[0].removesuffix("/.default")
        token, expires = mint_token(audience)
        return AccessToken(token, expires)


