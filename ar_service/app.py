"""The AR service's composition root: settings in, FastAPI app out.

The engine starts in a worker thread inside the lifespan, so ``/healthz`` answers at once and
``/readyz`` says "loading" until the engine is up and warmed and the DiT is ready (and compatible).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import torch
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry

from ar_service import __version__
from ar_service.admission import RequestAdmission
from ar_service.api.router import build_router
from ar_service.api.serving import ImageServing
from ar_service.dit_peer import DitPeer
from ar_service.engine.hidden_state_engine import EngineRequest, HiddenStateEngine
from ar_service.handoff_client import HandoffClient
from ar_service.image_generation import ImageGenerator
from ar_service.image_store import ImageStore
from ar_service.metrics import ArMetrics
from ar_service.prompt_builder import PromptBuilder
from ar_service.readiness import ArReadiness
from ar_service.settings import ArSettings
from services.app import create_app
from services.auth import BearerAuth
from services.errors import ApiError
from services.metrics import new_registry

log = logging.getLogger("ardit.ar.app")


@dataclass
class ArRuntime:
    """What the running service holds; tests and benchmarks reach the engine through it."""

    settings: ArSettings
    engine: HiddenStateEngine
    prompts: PromptBuilder
    generator: ImageGenerator
    readiness: ArReadiness
    metrics: ArMetrics


def create_ar_app(settings: ArSettings, registry: CollectorRegistry | None = None) -> FastAPI:
    registry = registry if registry is not None else new_registry()
    metrics = ArMetrics(registry)
    engine = HiddenStateEngine(settings)
    prompts = PromptBuilder.from_model_dir(settings.model_dir, settings.prompt_template)
    dit_http = httpx.AsyncClient(
        base_url=settings.dit_url,
        timeout=httpx.Timeout(settings.dit_timeout_seconds, connect=settings.dit_connect_timeout_seconds),
        limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
    )
    token = settings.handoff_token.get_secret_value() if settings.handoff_token else None
    generator = ImageGenerator(settings, engine, prompts, HandoffClient(dit_http, token), metrics)
    readiness = ArReadiness(DitPeer(dit_http, hidden_size=engine.shape.hidden_size, conditioning=settings.conditioning))
    runtime = ArRuntime(settings, engine, prompts, generator, readiness, metrics)
    metrics.build_info.info(
        {
            "version": __version__,
            "model": settings.model_dir.name,
            "dtype": settings.dtype,
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            "conditioning": settings.conditioning,
            "prefix_caching": str(settings.enable_prefix_caching).lower(),
        }
    )

    async def start_engine() -> None:
        try:
            await asyncio.to_thread(engine.start)
            metrics.vllm.capture()
            # One tiny request runs the whole capture path once before traffic does.
            warm = EngineRequest(
                engine_request_id=f"warmup:{secrets.token_hex(4)}", prompt_token_ids=prompts.build("warm up").token_ids
            )
            async for _ in engine.run(warm):
                pass
            readiness.engine_ready = True
            log.info("AR engine ready (block size %d)", engine.block_size)
        except Exception as exc:  # readiness reports it; the process stays up for /healthz
            readiness.engine_error = f"{type(exc).__name__}: {exc}"
            log.exception("AR engine failed to start")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        starting = asyncio.create_task(start_engine())
        try:
            yield
        finally:
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            await dit_http.aclose()
            await asyncio.to_thread(engine.shutdown)

    app = create_app(
        "ardit AR service", lifespan=lifespan, readiness=readiness.probe, registry=registry, app_metrics=metrics.app
    )
    app.state.runtime = runtime
    admission = RequestAdmission(settings.max_concurrent_requests, settings.max_queued_requests, metrics)
    serving = ImageServing(
        settings, generator, ImageStore(settings.image_store_size, settings.image_ttl_seconds), metrics, readiness
    )
    api_keys = BearerAuth(
        settings.api_keys, what="API key", missing_code="missing_api_key", invalid_code="invalid_api_key"
    )
    app.include_router(build_router(serving, admission, api_keys))

    admin = BearerAuth(
        [settings.admin_token.get_secret_value()] if settings.admin_token else [],
        what="admin token",
        missing_code="invalid_admin_token",
        invalid_code="invalid_admin_token",
    )

    @app.post("/admin/reset_prefix_cache", include_in_schema=False)
    async def reset_prefix_cache(request: Request) -> dict:
        # Without a (non-empty) admin token the endpoint does not exist.
        if not admin.enabled:
            raise ApiError(404, "not found", code="not_found")
        admin.check(request.headers.get("authorization"))
        return {"reset": await engine.reset_prefix_cache()}

    return app
