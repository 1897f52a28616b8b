"""The public port's gate, before anything parses a request: the API key, then the body's size and
how long it takes to arrive.

Pure ASGI, in front of the app: a request without a valid key is answered
401 before one byte of its body is read (a valid key's tenant goes on ``request.state.tenant``), and
a path another token guards (``guarded_paths``: the AR's ``/metrics`` with keys on) without that one; a
body over its cap — ``max_body_bytes``, or a path's own in ``path_body_bytes`` (image uploads) — is
a 413 (from ``Content-Length`` at once, or as soon as the count passes the cap), and a body that
does not arrive within ``body_timeout`` seconds (a slow or lying client) is a 408, which closes the
connection (``Connection: close``): a client that slow has no next request worth waiting for. (A 413
keeps it: uvicorn reads and drops the rest of the body, where closing on unread bytes would reset the
connection and lose the answer.) The body is then replayed to the app, so handlers parse at most their
cap and never wait on a slow client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.auth import BearerAuth
from services.errors import ApiError, ErrorObserver


class RequestGate:
    def __init__(
        self,
        app: ASGIApp,
        *,
        auth: BearerAuth,
        max_body_bytes: int,
        body_timeout: float,
        open_paths: Iterable[str],
        own_auth_prefixes: Iterable[str] = (),
        on_refusal: ErrorObserver,
        open_get_prefixes: Iterable[str] = (),
        path_body_bytes: Mapping[str, int] | None = None,
        guarded_paths: Mapping[str, BearerAuth] | None = None,
    ) -> None:
        """``open_paths`` need no key (probes, metrics), nor do GETs under ``open_get_prefixes``
        (URLs that are capabilities); ``own_auth_prefixes`` check their own token; ``guarded_paths``
        take their own token instead of a key; ``on_refusal`` sees every refusal (the service's error
        counter)."""
        self.app = app
        self._auth = auth
        self._max_body = max_body_bytes
        self._path_body = dict(path_body_bytes or {})
        self._timeout = body_timeout
        self._open = frozenset(open_paths)
        self._open_get = tuple(open_get_prefixes)
        self._own_auth = tuple(own_auth_prefixes)
        self._guarded = dict(guarded_paths or {})
        self._on_refusal = on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            path = scope["path"]
            guard = self._guarded.get(path)
            if guard is not None:
                guard.check(header(scope, b"authorization"))
            elif self._auth.enabled and not self._is_open(scope["method"], path):
                # Starlette's request.state is this dict: the route learns whose key it was.
                scope.setdefault("state", {})["tenant"] = self._auth.check(header(scope, b"authorization"))
            body = await self._read_body(scope, receive, self._path_body.get(path, self._max_body))
        except ApiError as refused:
            self._on_refusal(refused)
            await refused.response()(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    def _is_open(self, method: str, path: str) -> bool:
        if path in self._open or path.startswith(self._own_auth):
            return True
        return method in ("GET", "HEAD") and bool(self._open_get) and path.startswith(self._open_get)

    async def _read_body(self, scope: Scope, receive: Receive, limit: int) -> bytes:
        declared = header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise _too_large(limit)
        chunks: list[bytes] = []
        size = 0
        # One deadline for the whole body; ``asyncio.timeout`` adds no task when the body is already
        # here (``wait_for`` made one per message, and a burst's every request paid for it).
        try:
            async with asyncio.timeout(self._timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise ApiError(499, "client closed the request", code="client_closed_request")
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise _too_large(limit)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            raise ApiError(
                408,
                f"the request body did not arrive within {self._timeout:g} s",
                code="request_timeout",
                headers=_CLOSE,
            ) from None


_CLOSE = {"Connection": "close"}


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over {limit} bytes", code="request_too_large")


def header(scope: Scope, name: bytes) -> str | None:
    """The value of the request header ``name`` (lower case), if the request has it."""
    for key, value in scope.get("headers") or []:
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """The app's receive: the whole body once, then the client's own messages (disconnects)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
