"""The handler of last resort: an exception nobody foresaw still gets an OpenAI-shaped answer.

Pure ASGI, just inside the request-id layer: it catches what escapes the app, logs the traceback once
(with the request id, through the log filter), counts it like every error body, and answers ``500``
with an OpenAI body that carries the request id. When the response had already started, it can only
count it and let the server cut the connection (and log the traceback, once).
"""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.errors import ApiError, ErrorObserver

log = logging.getLogger("ardit.errors")


class LastResort:
    def __init__(self, app: ASGIApp, on_error: ErrorObserver) -> None:
        self.app = app
        self._on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking)
        except Exception:
            error = ApiError(
                500,
                "the server failed on this request; its log has the details under request id "
                f"{scope.get('state', {}).get('request_id', '-')}",
                type="server_error",
                code="internal_error",
            )
            self._on_error(error)
            if started:
                # The status line is out: the server logs the traceback and cuts the connection, so the
                # client sees a truncated answer, not one that looks complete.
                raise
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            await error.response()(scope, receive, send)
