"""The DiT service's composition root: settings in, FastAPI app out.

The model loads in the background (``ModelState``), so ``/healthz`` answers at once and ``/readyz``
says "loading" until the model is loaded and warmed; ``/v1/handoff`` answers 503 until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator

from fastapi import FastAPI
from starlette.types import Scope

from dit_service.admission import AdmissionControl
from dit_service.handoff_endpoint import HANDOFF_PATH, HandoffEndpoint
from dit_service.handoff_intake import HandoffIntake
from dit_service.handoff_services import HandoffServices, serve_model
from dit_service.metrics import DitMetrics
from dit_service.model import DitModel
from dit_service.model_state import ModelState
from dit_service.settings import DitSettings
from services.app import create_app
from services.auth import BearerAuth
from services.connection_guard import ConnectionGuard
from services.drain import Drain
from services.fatal import Fatal
from services.heap import IdleRelease, return_free_pages_in_thread
from services.metrics import Families, new_registry
from shared.capabilities import Pace
from shared.result_frames import RESERVATION_HEADER, RESERVATIONS_PATH
from shared.row_buffer_pool import RowBufferPool


def create_dit_app(settings: DitSettings) -> FastAPI:
    fatal = Fatal()
    metrics = DitMetrics.of_service(new_registry(), settings)
    admission = AdmissionControl(
        max_handoffs=settings.max_concurrent_handoffs,
        max_runs=settings.max_pipeline_runs,
        queue_size=settings.pipeline_queue_size,
        retry_after_seconds=settings.retry_after_seconds,
        reservation_seconds=settings.reservation_seconds,
    )
    state: ModelState[HandoffServices] = ModelState(settings.retry_after_seconds, _announcement, fatal)
    load = functools.partial(DitModel.load, settings.model_dir, settings.device, settings.torch_dtype_name)
    idle = IdleRelease(settings.release_memory_idle_seconds, return_free_pages_in_thread)
    serve = functools.partial(serve_model, settings, metrics=metrics, admission=admission, fatal=fatal, idle=idle)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(state.load(load, serve))
        try:
            yield
        finally:
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loading
            await idle.aclose()

    # A handoff's trace context travels in its open frame (dit_service/handoff_trace.py), not in headers.
    app = create_app(
        "ardit DiT service",
        lifespan=lifespan,
        readiness=state.readiness,
        fatal=fatal,
        # Draining, the DiT stops once no place is held: what an AR reserved still arrives and renders.
        drain=Drain(settings.drain_seconds, holding=lambda: admission.taken > 0),
        admitted_while_draining=_holds_a_place,
        app_metrics=metrics.app,
        untraced_paths=(HANDOFF_PATH,),
        connections=ConnectionGuard(
            Families(metrics.app.registry, "dit"),
            head_timeout=settings.request_head_timeout_seconds,
            max_head_bytes=settings.max_request_head_bytes,
            max_connections=settings.max_connections,
        ),
    )
    pool = RowBufferPool(settings.idle_row_buffer_bytes) if settings.idle_row_buffer_bytes else None
    intake = HandoffIntake(
        settings.assembly_caps,
        settings.frame_limits,
        settings.stall_timeout_seconds,
        settings.handoff_deadline_seconds,
        metrics,
        pool,
    )
    HandoffEndpoint(handoff_auth(settings), admission, intake, state.require, metrics).mount(app)
    return app


def _holds_a_place(scope: Scope) -> bool:
    """While draining: a handoff that names its reservation comes in, and so does giving a place back."""
    if scope["method"] == "DELETE":
        return str(scope["path"]).startswith(RESERVATIONS_PATH + "/")
    return scope["path"] == HANDOFF_PATH and any(name == RESERVATION_HEADER.encode() for name, _ in scope["headers"])


def _announcement(served: HandoffServices, pace: Pace) -> dict[str, object]:
    """What a ready DiT's /readyz body says of it (read by every AR): its capabilities and measured pace."""
    capabilities = served.capabilities.model_copy(update={"pace": pace})
    return {"capabilities": capabilities.model_dump(mode="json")}


def handoff_auth(settings: DitSettings) -> BearerAuth:
    """The internal token both services share (``ARDIT_HANDOFF_TOKEN``)."""
    tokens = [settings.handoff_token.get_secret_value()] if settings.handoff_token is not None else []
    return BearerAuth(
        tokens, what="handoff token", missing_code="invalid_handoff_token", invalid_code="invalid_handoff_token"
    )
