"""The app factory both services use: error bodies, request ids, health, readiness, metrics, traces.

Each service passes a readiness probe (model loaded and warmed, peer reachable) and its routers;
everything an operator relies on behaves the same on both: every response is counted by route,
method and status, every error body by its code, readiness is exported at each scrape
(``AppMetrics``), and every request but the probes and what ``untraced_paths`` match gets a server span
(``services.tracing``).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from services.app_metrics import AppMetrics
from services.connection_guard import ConnectionGuard
from services.drain import Drain
from services.errors import ErrorBody, install_error_handlers
from services.fatal import Fatal
from services.last_resort import LastResort
from services.request_context import RequestIdMiddleware
from services.slow_readers import SlowReaders
from services.tracing import instrument_app


class _Wrapped:
    """Adapts a plain ``app -> app`` wrapper to Starlette's middleware stack."""

    def __init__(self, app: ASGIApp, wrap: Callable[[ASGIApp], ASGIApp]) -> None:
        self._wrapped = wrap(app)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._wrapped(scope, receive, send)


@dataclass(frozen=True)
class Readiness:
    ready: bool
    reason: str
    # More of the /readyz body (the DiT announces its capabilities here).
    details: Mapping[str, Any] | None = None


# Must be cheap: probes call it every few seconds.
ReadinessProbe = Callable[[], Awaitable[Readiness]]

# What orchestrators, gateways and Prometheus call: open without a key, never refused while draining.
PROBE_PATHS = ("/healthz", "/health", "/readyz", "/metrics")


def create_app(
    title: str,
    *,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None,
    readiness: ReadinessProbe,
    app_metrics: AppMetrics,
    fatal: Fatal,
    drain: Drain,
    admitted_while_draining: Callable[[Scope], bool] = lambda scope: False,
    untraced_paths: Iterable[str] = (),  # regular expressions, each matching a whole path
    gate: Callable[[ASGIApp], ASGIApp] | None = None,
    door: Callable[[ASGIApp], ASGIApp] | None = None,
    slow_readers: SlowReaders | None = None,
    connections: ConnectionGuard | None = None,
) -> FastAPI:
    """``gate`` wraps the app inside the request-id layer (so its refusals carry the id too), and
    ``drain``'s gate wraps that (``admitted_while_draining``: what must still come in while draining);
    ``door`` wraps everything, traces and metrics included: a decision that must cost next to nothing for
    hundreds of requests at once (the AR's admission), whose answers it writes, counts, ids and logs itself.
    ``fatal``, ``drain``, ``slow_readers`` and ``connections`` go on ``app.state``, where ``services.serve`` finds
    them."""
    app = FastAPI(title=title, lifespan=lifespan)
    app.state.fatal = fatal
    app.state.drain = drain
    app.state.slow_readers = slow_readers
    app.state.connections = connections
    install_error_handlers(app, app_metrics.count_error)
    if gate is not None:
        app.add_middleware(_Wrapped, wrap=gate)
    app.add_middleware(LastResort, on_error=app_metrics.count_error)
    app.add_middleware(
        _Wrapped,
        wrap=lambda inner: drain.gate(
            inner,
            always_open=PROBE_PATHS,
            admitted_while_draining=admitted_while_draining,
            on_refusal=app_metrics.count_error,
        ),
    )
    app.add_middleware(RequestIdMiddleware)
    app_metrics.install(app)
    instrument_app(app, (*(re.escape(path) for path in PROBE_PATHS), *untraced_paths))
    if door is not None:
        app.add_middleware(_Wrapped, wrap=door)
    _add_probes(app, readiness, drain, app_metrics)
    _document_400_not_422(app)
    return app


def _add_probes(app: FastAPI, readiness: ReadinessProbe, drain: Drain, app_metrics: AppMetrics) -> None:
    """``/healthz`` (and vLLM's ``/health``), ``/readyz`` (not ready while draining) and ``/metrics``."""

    async def ready() -> Readiness:
        if drain.started:
            return Readiness(False, "draining: shutting down, finishing the requests in flight")
        return await readiness()

    @app.get("/healthz", include_in_schema=False)
    @app.get("/health", include_in_schema=False)  # vLLM's name, which routers (vllm-router) call
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> JSONResponse:
        state = await ready()
        body = {"status": "ready" if state.ready else "not_ready", "reason": state.reason, **(state.details or {})}
        return JSONResponse(body, status_code=200 if state.ready else 503)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        app_metrics.ready.set(int((await ready()).ready))
        return Response(generate_latest(app_metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _document_400_not_422(app: FastAPI) -> None:
    """Invalid input is answered 400 with the OpenAI body (install_error_handlers), never FastAPI's
    422: the OpenAPI document says what the service really returns."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    responses = operation.get("responses", {})
                    if "HTTPValidationError" not in str(responses.get("422", "")):
                        continue  # a 422 the service itself answers (the DiT's refusals)
                    del responses["422"]
                    if "400" not in responses:
                        responses["400"] = {
                            "description": "invalid_request_error",
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}},
                        }
            schemas = schema.get("components", {}).get("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            schemas.setdefault("ErrorBody", ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}"))
            schemas.update(ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}").get("$defs", {}))
            schemas["ErrorBody"].pop("$defs", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
