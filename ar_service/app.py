"""The AR service's composition root: settings in, FastAPI app out.

The engine starts in the background (``engine_watch``), so ``/healthz`` answers at once and
``/readyz`` says "loading" until the engine is up and warmed and a DiT is ready (and compatible).
``app.state.runtime`` is the in-process handle on the running service (its engine, settings and
DiT pool), for code that runs beside it in one process: the test suite and the engine benchmarks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.types import ASGIApp

from ar_service.admission import RequestAdmission
from ar_service.api.admin import admin_auth, build_admin_router
from ar_service.api.admission_door import AdmissionDoor
from ar_service.api.router import EDITS, IMAGE_ROUTES, RENDER, build_router
from ar_service.api.serving import ImageServing
from ar_service.api.validation import RequestValidator
from ar_service.dit_pool import DitPool
from ar_service.engine.hidden_state_engine import HiddenStateEngine
from ar_service.engine_watch import run_engine
from ar_service.image_generation import ImageGenerator
from ar_service.image_store import IMAGE_NAME, ImageStore, image_store
from ar_service.input_images import EditMemory
from ar_service.metrics import ArMetrics
from ar_service.negative_rows import NegativeRows
from ar_service.prompt_builder import PromptBuilder
from ar_service.readiness import ArReadiness
from ar_service.settings import ArSettings
from services.app import PROBE_PATHS, create_app
from services.auth import BearerAuth
from services.connection_guard import ConnectionGuard
from services.drain import Drain
from services.fatal import Fatal
from services.internal_port import InternalPort
from services.metrics import Families, new_registry
from services.request_gate import RequestGate
from services.slow_readers import SlowReaders


@dataclass(frozen=True)
class ArRuntime:
    """What the running service holds, for code in the same process (tests, benchmarks)."""

    settings: ArSettings
    engine: HiddenStateEngine
    prompts: PromptBuilder
    dits: DitPool
    readiness: ArReadiness
    admission: RequestAdmission


def create_ar_app(settings: ArSettings) -> FastAPI:
    fatal = Fatal()
    engine = HiddenStateEngine(settings)
    metrics = ArMetrics.of_service(new_registry(), settings, engine.rows)
    prompts = PromptBuilder.of_text_model(engine.text_model, engine.rows)
    dits = DitPool.of_settings(settings, engine.rows, engine.row_width)
    readiness = ArReadiness(dits)
    admission = RequestAdmission(
        settings.max_queued_requests,
        settings.max_queue_wait_seconds,
        metrics,
        max_key_wait=settings.max_queue_wait_per_key_seconds if settings.api_keys else None,
    )
    store = image_store(
        settings.image_store_url, settings.image_store_size, settings.image_store_bytes, settings.image_ttl_seconds
    )
    drain = Drain(settings.drain_seconds)
    keys = BearerAuth(settings.api_keys, what="API key", missing_code="missing_api_key", invalid_code="invalid_api_key")
    admin = admin_auth(settings.admin_token.get_secret_value() if settings.admin_token else None)
    generator = ImageGenerator(settings, engine, prompts, dits, metrics, NegativeRows(settings.negative_rows_bytes))
    validator = RequestValidator(settings, prompts, EditMemory(settings.max_edit_memory_bytes))
    serving = ImageServing(settings, readiness, validator, admission, generator, store, metrics, drain)
    runtime = ArRuntime(settings, engine, prompts, dits, readiness, admission)
    app = create_app(
        "ardit AR service",
        lifespan=_lifespan(runtime, metrics, fatal, store),
        readiness=readiness.probe,
        fatal=fatal,
        drain=drain,
        app_metrics=metrics.app,
        # A url image's name is its credential: its fetches get no span (nor an access-log name, see __main__).
        untraced_paths=("/v1/images/" + IMAGE_NAME,),
        gate=lambda inner: _gate(inner, settings, metrics, keys, admin),
        door=lambda inner: _door(inner, settings, metrics, keys, admission, readiness, drain),
        slow_readers=SlowReaders(
            Families(metrics.app.registry, "ar"),
            send_timeout=settings.send_timeout_seconds,
            max_responses=settings.max_slow_readers,
            max_bytes=settings.max_slow_reader_bytes,
        ),
        connections=ConnectionGuard(
            Families(metrics.app.registry, "ar"),
            head_timeout=settings.request_head_timeout_seconds,
            max_head_bytes=settings.max_request_head_bytes,
            max_connections=settings.max_connections,
            body_timeout=settings.request_body_timeout_seconds,
        ),
    )
    app.state.runtime = runtime
    app.include_router(build_router(serving, settings.sse_keepalive_seconds))
    app.include_router(build_admin_router(admin, engine))
    return app


def _lifespan(
    runtime: ArRuntime, metrics: ArMetrics, fatal: Fatal, store: ImageStore
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """What runs beside the app while it serves: the engine, started and watched, and the DiT names
    kept resolved; at shutdown both stop and every client the service holds is closed."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await runtime.dits.refresh()
        background = [
            asyncio.create_task(run_engine(runtime.engine, runtime.prompts, runtime.readiness, metrics, fatal)),
            asyncio.create_task(runtime.dits.keep_resolved(runtime.settings.dit_resolve_seconds)),
        ]
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await runtime.dits.aclose()
            await store.aclose()
            await runtime.engine.aclose()

    return lifespan


def _door(
    inner: ASGIApp,
    settings: ArSettings,
    metrics: ArMetrics,
    keys: BearerAuth,
    admission: RequestAdmission,
    readiness: ArReadiness,
    drain: Drain,
) -> AdmissionDoor:
    """The image routes' admission door, in front of every other layer: a request the line has no room
    for is refused before anything else runs for it."""
    return AdmissionDoor(
        inner,
        admission=admission,
        readiness=readiness,
        paths=IMAGE_ROUTES,
        auth=keys,
        drain=drain,
        metrics=metrics.app,
        internal_port=settings.internal_port,
    )


def _gate(inner: ASGIApp, settings: ArSettings, metrics: ArMetrics, keys: BearerAuth, admin: BearerAuth) -> ASGIApp:
    """The public port's gate: API keys, then each body's size and arrival deadline. With keys on,
    ``/metrics`` there is the operator's (the admin token): at low traffic its histograms tell one
    request's prompt tokens and timings, which one tenant must not read of another. The internal
    port, when there is one, takes the render call and the probes, metrics included, with no key."""
    operators = {"/metrics": admin} if keys.enabled else {}
    public = RequestGate(
        inner,
        auth=keys,
        max_body_bytes=settings.max_request_body_bytes,
        body_timeout=settings.request_body_timeout_seconds,
        open_paths=(*(p for p in PROBE_PATHS if p not in operators), "/openapi.json", "/docs", "/redoc"),
        guarded_paths=operators,
        own_auth_prefixes=("/admin/",),
        on_refusal=metrics.app.count_error,
        # A response_format=url link is a capability: its unguessable id is the credential.
        open_get_prefixes=("/v1/images/",),
        path_body_bytes={EDITS: settings.max_edit_body_bytes},
    )
    if settings.internal_port is None:
        return public
    internal = RequestGate(
        inner,
        auth=BearerAuth([], what="API key", missing_code="missing_api_key", invalid_code="invalid_api_key"),
        max_body_bytes=settings.max_request_body_bytes,
        body_timeout=settings.request_body_timeout_seconds,
        open_paths=(),
        on_refusal=metrics.app.count_error,
    )
    return InternalPort(public, internal, port=settings.internal_port, paths=(RENDER, *PROBE_PATHS))
