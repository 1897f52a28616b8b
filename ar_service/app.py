"""The AR service's composition root: settings in, FastAPI app out.

The engine starts in a worker thread inside the lifespan, so ``/healthz`` answers at once and
``/readyz`` says "loading" until the engine is up and warmed and the DiT answers its own readyz.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry

from ar_service import __version__
from ar_service.admission import RequestAdmission
from ar_service.engine import EngineRequest, HiddenStateEngine
from ar_service.handoff_client import HandoffClient
from ar_service.image_api import ImageApi, build_router
from ar_service.image_generation import ImageGenerator
from ar_service.image_store import ImageStore
from ar_service.metrics import ArMetrics
from ar_service.prompt_builder import PromptBuilder
from ar_service.settings import ArSettings
from services.app import create_app
from services.errors import ApiError

log = logging.getLogger("ardit.ar.app")

# The DiT's readiness is asked at most this often; probes come every few seconds.
_PEER_CHECK_SECONDS = 2.0


@dataclass
class ArRuntime:
    """What the running service holds; tests and benchmarks reach the engine through it."""

    settings: ArSettings
    engine: HiddenStateEngine
    prompts: PromptBuilder
    dit: HandoffClient
    generator: ImageGenerator
    metrics: ArMetrics
    engine_ready: bool = False
    engine_error: str | None = None
    peer_ready: bool = False
    peer_checked_at: float = 0.0


def create_ar_app(settings: ArSettings, registry: CollectorRegistry | None = None) -> FastAPI:
    registry = registry if registry is not None else CollectorRegistry()
    metrics = ArMetrics(registry)
    engine = HiddenStateEngine(settings)
    prompts = PromptBuilder.from_model_dir(settings.model_dir, settings.prompt_template)
    token = settings.handoff_token.get_secret_value() if settings.handoff_token else None
    dit = HandoffClient(settings.dit_url, token, settings.dit_connect_timeout_seconds, settings.dit_timeout_seconds)
    generator = ImageGenerator(settings, engine, prompts, dit, metrics)
    runtime = ArRuntime(settings, engine, prompts, dit, generator, metrics)
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
            # One tiny request runs the whole capture path once before traffic does.
            warm = EngineRequest(stream_id=f"warmup:{secrets.token_hex(4)}", prompt_token_ids=prompts.build("warm up").token_ids)
            async for _ in engine.stream(warm):
                pass
            runtime.engine_ready = True
            log.info("AR engine ready (block size %d)", engine.block_size)
        except Exception as exc:  # readiness reports it; the process stays up for /healthz
            runtime.engine_error = f"{type(exc).__name__}: {exc}"
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
            await dit.aclose()
            await asyncio.to_thread(engine.shutdown)

    async def readiness() -> tuple[bool, str]:
        if runtime.engine_error:
            return False, f"engine failed: {runtime.engine_error}"
        if not runtime.engine_ready:
            return False, "engine loading"
        now = time.monotonic()
        if now - runtime.peer_checked_at > _PEER_CHECK_SECONDS:
            runtime.peer_ready = await dit.ready()
            runtime.peer_checked_at = now
        return (True, "ready") if runtime.peer_ready else (False, "DiT service not ready or unreachable")

    app = create_app("ardit AR service", lifespan=lifespan, readiness=readiness, registry=registry)
    app.state.runtime = runtime
    admission = RequestAdmission(settings.max_concurrent_requests, settings.max_queued_requests, metrics)
    store = ImageStore(settings.image_store_size, settings.image_ttl_seconds)
    api = ImageApi(settings, generator, admission, store, metrics, readiness)

    app.include_router(build_router(api))

    @app.post("/admin/reset_prefix_cache", include_in_schema=False)
    async def reset_prefix_cache(request: Request) -> dict:
        if settings.admin_token is None:
            raise ApiError(404, "not found", code="not_found")
        header = request.headers.get("authorization", "")
        if not secrets.compare_digest(header, f"Bearer {settings.admin_token.get_secret_value()}"):
            raise ApiError(401, "admin token required", code="invalid_admin_token")
        return {"reset": await engine.reset_prefix_cache()}

    return app
