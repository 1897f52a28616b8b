"""The app factory both services use: error bodies, request ids, health, readiness, metrics.

Each service passes a readiness probe (model loaded and warmed, peer reachable) and its routers;
everything an operator relies on behaves the same on both.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

from services.errors import install_error_handlers
from services.request_context import RequestIdMiddleware

# Returns (ready, reason). Must be cheap: probes call it every few seconds.
ReadinessProbe = Callable[[], Awaitable[tuple[bool, str]]]


def create_app(
    title: str,
    *,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None,
    readiness: ReadinessProbe,
    registry: CollectorRegistry = REGISTRY,
) -> FastAPI:
    app = FastAPI(title=title, lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(RequestIdMiddleware)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> JSONResponse:
        ready, reason = await readiness()
        return JSONResponse({"status": "ready" if ready else "not_ready", "reason": reason}, status_code=200 if ready else 503)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
