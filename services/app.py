"""The app factory both services use: error bodies, request ids, health, readiness, metrics, traces.

Each service passes a readiness probe (model loaded and warmed, peer reachable) and its routers;
everything an operator relies on behaves the same on both: every response is counted by route,
method and status, every error body by its code, readiness is exported at each scrape
(``AppMetrics``), and every request but the probes and ``untraced_paths`` gets a server span
(``services.tracing``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from services.app_metrics import AppMetrics
from services.errors import install_error_handlers
from services.request_context import RequestIdMiddleware
from services.tracing import instrument_app


@dataclass(frozen=True)
class Readiness:
    ready: bool
    reason: str
    # More of the /readyz body (the DiT announces its capabilities here).
    details: Mapping[str, Any] | None = None


# Must be cheap: probes call it every few seconds.
ReadinessProbe = Callable[[], Awaitable[Readiness]]


def create_app(
    title: str,
    *,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None,
    readiness: ReadinessProbe,
    registry: CollectorRegistry,
    app_metrics: AppMetrics,
    untraced_paths: Iterable[str] = (),
) -> FastAPI:
    app = FastAPI(title=title, lifespan=lifespan)
    install_error_handlers(app, app_metrics.count_error)
    app.add_middleware(RequestIdMiddleware)
    app_metrics.install(app)
    instrument_app(app, untraced_paths)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> JSONResponse:
        state = await readiness()
        body = {"status": "ready" if state.ready else "not_ready", "reason": state.reason, **(state.details or {})}
        return JSONResponse(body, status_code=200 if state.ready else 503)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        app_metrics.ready.set(int((await readiness()).ready))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
