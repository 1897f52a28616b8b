"""Request ids: taken from ``x-request-id`` when a caller sends one, made otherwise, echoed on
every response and put on every log record, so one id follows a request through both services."""

from __future__ import annotations

import contextvars
import logging
import re
import secrets

from opentelemetry import trace
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "x-request-id"
_VALID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


def new_request_id() -> str:
    # 128 random bits in hex, the length uuid4().hex had, at a quarter of its cost (UUID's object and
    # version digits), which a burst of refusals at the AR's door pays once each.
    return f"req_{secrets.token_hex(16)}"


def request_id_of(scope: Scope) -> str:
    """The caller's ``x-request-id`` when it is a valid one, a new id otherwise."""
    incoming = dict(scope.get("headers") or []).get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
    return incoming if _VALID.match(incoming) else new_request_id()


class RequestIdMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnects pass through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        # The id in the logs finds the request's trace (the server span is the current one here).
        trace.get_current_span().set_attribute("ardit.request_id", request_id)
        token = request_id_var.set(request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (REQUEST_ID_HEADER.encode(), request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)


class RequestIdLogFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


def configure_logging(service: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdLogFilter())
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s [%(request_id)s] %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
