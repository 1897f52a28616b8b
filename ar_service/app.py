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
from starlette.types import ASGIApp

from ar_service import __version__
from ar_service.admission import RequestAdmission
from ar_service.api.router import build_router
from ar_service.api.serving import ImageServing
from ar_service.dit_pool import DitPool
from ar_service.engine.hidden_state_engine import EngineRequest, HiddenStateEngine
from ar_service.image_generation import ImageGenerator
from ar_service.image_store import ImageStore
from ar_service.metrics import ArMetrics
from ar_service.prompt_builder import PromptBuilder
from ar_service.readiness import ArReadiness
from ar_service.settings import ArSettings
from services.app import create_app
from services.auth import BearerAuth
from services.errors import ApiError
from services.fatal import Fatal
from services.metrics import new_registry
from services.request_gate import RequestGate

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
    admission: RequestAdmission
    serving: ImageServing


# How often a running engine is checked for death; readiness turns 503 within this.
ENGINE_CHECK_SECONDS = 0.2


def create_ar_app(
    settings: ArSettings, registry: CollectorRegistry | None = None, fatal: Fatal | None = None
) -> FastAPI:
    registry = registry if registry is not None else new_registry()
    fatal = fatal if fatal is not None else Fatal()
    metrics = ArMetrics(registry)
    engine = HiddenStateEngine(settings)
    prompts = PromptBuilder.from_model_dir(settings.model_dir, settings.prompt_template)

    def dit_client(base_url: str) -> httpx.AsyncClient:
        # Reads and writes time out after the stall timeout: the DiT sends progress while it works
        # (queued or rendering), so silence that long means it froze.
        return httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(settings.dit_stall_timeout_seconds, connect=settings.dit_connect_timeout_seconds),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
        )

    dits = DitPool.from_setting(
        settings.dit_url,
        make_client=dit_client,
        token=settings.handoff_token.get_secret_value() if settings.handoff_token else None,
        deadline_seconds=settings.dit_timeout_seconds,
        hidden_size=engine.shape.hidden_size,
        conditioning=settings.conditioning,
    )
    generator = ImageGenerator(settings, engine, prompts, dits, metrics)
    readiness = ArReadiness(dits)
    admission = RequestAdmission(settings.max_queued_requests, settings.max_queue_wait_seconds, metrics)
    serving = ImageServing(
        settings,
        generator,
        ImageStore(settings.image_store_size, settings.image_store_bytes, settings.image_ttl_seconds),
        metrics,
        readiness,
    )
    runtime = ArRuntime(settings, engine, prompts, generator, readiness, metrics, admission, serving)
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

    def engine_failed(reason: str) -> None:
        readiness.engine_error = reason
        fatal.trigger(f"AR engine: {reason}")

    async def run_engine() -> None:
        """Start and warm the engine, then watch it: an engine that fails or dies is fatal."""
        try:
            await asyncio.to_thread(engine.start)
            metrics.vllm.capture()
            # One tiny request runs the whole capture path once before traffic does.
            warm = EngineRequest(
                engine_request_id=f"warmup:{secrets.token_hex(4)}", prompt_token_ids=prompts.build("warm up").token_ids
            )
            async for _ in engine.run(warm):
                pass
        except Exception as exc:
            log.exception("AR engine failed to start")
            engine_failed(f"failed to start ({type(exc).__name__}: {exc})")
            return
        readiness.engine_ready = True
        log.info("AR engine ready (block size %d)", engine.block_size)
        while not engine.dead:
            await asyncio.sleep(ENGINE_CHECK_SECONDS)
        engine_failed("the engine died")

    async def resolve_dits() -> None:
        """DiT replicas come and go with their DNS answer (a Kubernetes headless Service)."""
        while True:
            await dits.refresh()
            await asyncio.sleep(settings.dit_resolve_seconds)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await dits.refresh()
        background = [asyncio.create_task(run_engine()), asyncio.create_task(resolve_dits())]
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await dits.aclose()
            await asyncio.to_thread(engine.shutdown)

    api_keys = BearerAuth(
        settings.api_keys, what="API key", missing_code="missing_api_key", invalid_code="invalid_api_key"
    )

    def gate(inner: ASGIApp) -> ASGIApp:
        return RequestGate(
            inner,
            auth=api_keys,
            max_body_bytes=settings.max_request_body_bytes,
            body_timeout=settings.request_body_timeout_seconds,
            open_paths=("/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/redoc"),
            own_auth_prefixes=("/admin/",),
            on_refusal=metrics.app.count_error,
            # A response_format=url link is a capability: its unguessable id is the credential.
            open_get_prefixes=("/v1/images/",),
            path_body_bytes={"/v1/images/edits": settings.max_edit_body_bytes},
        )

    app = create_app(
        "ardit AR service",
        lifespan=lifespan,
        readiness=readiness.probe,
        registry=registry,
        app_metrics=metrics.app,
        gate=gate,
    )
    app.state.fatal = fatal
    app.state.runtime = runtime
    app.include_router(build_router(serving, admission))

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
