"""OpenAI-shaped error bodies, used by every HTTP surface of ardit.

``{"error": {"message", "type", "param", "code"}}`` is what OpenAI clients parse; the ``type``
values follow OpenAI's (``invalid_request_error``, ``authentication_error``, ...). No stack
traces ever reach a body: an exception nobody foresaw is ``services.last_resort``'s, a 500 that names
the request id its traceback is logged under. Every body the handlers render is reported to
``on_error`` first (the service's error counter).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """The body of every error answer (documented in the OpenAPI of both services)."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for these error statuses, all with the OpenAI error body."""
    return {status: {"model": ErrorBody, "description": _TYPE_BY_STATUS.get(status, "error")} for status in statuses}


class ApiError(Exception):
    """An error with an HTTP status and an OpenAI-shaped body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class Overloaded(ApiError):
    """429: no room for this request now (a full queue, or a wait longer than allowed).

    The one admission refusal of both services; ``Retry-After`` is whole seconds, at least 1.
    """

    def __init__(self, message: str, *, code: str, retry_after: float) -> None:
        super().__init__(429, message, code=code, headers={"Retry-After": str(max(1, math.ceil(retry_after)))})


def _param_of(loc: tuple[int | str, ...]) -> str | None:
    # FastAPI locations look like ("body", "size") or ("query", "limit").
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or None


ErrorObserver = Callable[[ApiError], None]
# The error code of an HTTP error the framework raised itself, by status.
_HTTP_CODES = {400: "invalid_request", 408: "request_timeout", 413: "request_too_large", 415: "unsupported_media_type"}


def install_error_handlers(app: FastAPI, on_error: ErrorObserver) -> None:
    def respond(error: ApiError) -> JSONResponse:
        on_error(error)
        return error.response()

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return respond(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        content_type = request.headers.get("content-type")
        if tuple(first.get("loc", ())) == ("body",) and not (content_type or "").startswith("application/json"):
            # A body sent without JSON's content type is not read as JSON at all: say which header to send.
            message = f"the body is read as JSON only with Content-Type: application/json (sent: {content_type})"
            return respond(ApiError(400, message, code="invalid_json"))
        if first.get("type") == "json_invalid":
            # loc is ("body", <offset>): where the JSON broke, not a parameter.
            where = first.get("loc", ("body", "?"))[-1]
            context = first.get("ctx")
            reason = context.get("error", first["msg"]) if isinstance(context, dict) else first["msg"]
            message = f"the body is not valid JSON: {reason} at character {where}"
            return respond(ApiError(400, message, code="invalid_json"))
        param = _param_of(tuple(first.get("loc", ())))
        if first.get("type") == "extra_forbidden":
            # OpenAI's own answer to a field it does not know.
            return respond(ApiError(400, f"Unknown parameter: '{param}'.", param=param, code="unknown_parameter"))
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        return respond(ApiError(400, message, param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        target = f"{request.method} {request.url.path}"
        if exc.status_code == 405:
            allowed = dict(exc.headers or {}).get("Allow", "")
            message = f"{request.method} is not allowed on {request.url.path}; it takes {allowed}"
            return respond(ApiError(405, message, code="method_not_allowed", headers={"Allow": allowed}))
        if exc.status_code == 404:
            return respond(ApiError(404, f"Invalid URL ({target})", code="not_found"))
        code = _HTTP_CODES.get(exc.status_code, "http_error")  # never a null code, whatever the framework raised
        return respond(ApiError(exc.status_code, str(exc.detail), code=code, headers=dict(exc.headers or {})))
