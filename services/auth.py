"""The one bearer-token check: public API keys, the admin endpoint and the internal handoff token.

A passing check names the token's *tenant*: a stable name that says nothing about the token (a
digest of it), which the AR salts each tenant's prefix cache with. Tokens are compared as bytes in
constant time. A header that is not ASCII cannot hold a valid token, so it is a 401 like any other
wrong token, never an exception. An empty configured token is no token: it enables nothing (an
empty bearer must never pass).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from services.errors import ApiError


class BearerAuth:
    """Accepts ``Authorization: Bearer <token>`` for any of ``tokens``; ``enabled`` iff one is set."""

    def __init__(self, tokens: Iterable[str], *, what: str, missing_code: str, invalid_code: str) -> None:
        self._tokens = [t.encode() for t in tokens if t]
        self._tenants = {t: hashlib.sha256(b"ardit tenant\0" + t).hexdigest()[:32] for t in self._tokens}
        self._what = what
        self._missing_code = missing_code
        self._invalid_code = invalid_code

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def check(self, authorization: str | None) -> str:
        """The tenant of the token the header carries; a 401 ``ApiError`` unless it carries one."""
        scheme, _, presented = (authorization or "").partition(" ")
        presented = presented.strip()
        if scheme.lower() != "bearer" or not presented:
            raise self._refuse(f"missing {self._what}: send Authorization: Bearer <token>", self._missing_code)
        # A non-ASCII header cannot hold a token (and compare_digest refuses non-ASCII str).
        given = presented.encode() if presented.isascii() else b""
        # Every token is compared, so the time does not say which one was close.
        matched = [token for token in self._tokens if hmac.compare_digest(given, token)]
        if not given or not matched:
            raise self._refuse(f"incorrect {self._what} provided", self._invalid_code)
        return self._tenants[matched[0]]

    @staticmethod
    def _refuse(message: str, code: str) -> ApiError:
        return ApiError(401, message, code=code, headers={"WWW-Authenticate": "Bearer"})
