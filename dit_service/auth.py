"""Bearer-token check for /v1/handoff (one token shared by the AR and DiT services)."""

from __future__ import annotations

import hmac

from pydantic import SecretStr

from services.errors import ApiError


class HandoffAuth:
    def __init__(self, token: SecretStr | None) -> None:
        self._token = token.get_secret_value().encode() if token is not None and token.get_secret_value() else None

    def check(self, authorization: str | None) -> None:
        if self._token is None:
            # Fail closed: an unconfigured receiver must not accept hidden states from anyone.
            raise ApiError(
                503, "the handoff token (ARDIT_HANDOFF_TOKEN) is not configured", code="handoff_auth_not_configured"
            )
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), self._token):
            raise ApiError(
                401,
                "missing or wrong bearer token",
                code="invalid_handoff_token",
                headers={"WWW-Authenticate": "Bearer"},
            )
