"""The DiT service's composition root: settings in, FastAPI app out."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import torch
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from pydantic import SecretStr
from starlette.responses import StreamingResponse

from dit_service import __version__
from dit_service.admission import AdmissionControl
from dit_service.batch_runner import BatchRunner
from dit_service.capabilities import dit_capabilities
from dit_service.conditioning import ConditioningAdapters, ConditioningOptions
from dit_service.handoff_endpoint import HANDOFF_PATH, HandoffEndpoint, HandoffServices
from dit_service.handoff_intake import HandoffIntake
from dit_service.image_encoder import ImageEncoder
from dit_service.latent_decoder import LatentDecoder
from dit_service.metrics import DitMetrics
from dit_service.model import DitModel
from dit_service.model_state import ModelState
from dit_service.open_frame_policy import OpenFramePolicy
from dit_service.pipeline_runner import PipelineRunner
from dit_service.render_scheduler import RenderScheduler
from dit_service.result_stream import ResultStream
from dit_service.settings import DitSettings
from services.app import create_app
from services.auth import BearerAuth
from services.errors import error_responses
from services.fatal import Fatal
from services.metrics import new_registry
from shared.result_frames import HANDOFF_MEDIA_TYPE, RESULT_MEDIA_TYPE
from shared.row_buffer_pool import RowBufferPool


def create_dit_app(
    settings: DitSettings, registry: CollectorRegistry | None = None, fatal: Fatal | None = None
) -> FastAPI:
    registry = registry if registry is not None else new_registry()
    fatal = fatal if fatal is not None else Fatal()
    metrics = DitMetrics(registry, cuda_device=torch.device(settings.device))
    metrics.pipeline_queue_capacity.set(settings.pipeline_queue_size)
    metrics.build_info.info(
        {
            "version": __version__,
            "model": settings.expected_model or settings.model_dir.name,
            "dtype": settings.torch_dtype_name,
            "device": settings.device,
        }
    )
    admission = AdmissionControl(
        max_handoffs=settings.max_concurrent_handoffs,
        max_runs=settings.max_pipeline_runs,
        queue_size=settings.pipeline_queue_size,
        retry_after_seconds=settings.retry_after_seconds,
    )
    state: ModelState[HandoffServices] = ModelState(
        settings.retry_after_seconds,
        lambda served: {"capabilities": served.capabilities.model_dump(mode="json")},
        fatal,
    )

    def load_model() -> DitModel:
        return DitModel.load(settings.model_dir, settings.device, settings.torch_dtype_name)

    def serve(model: DitModel) -> tuple[HandoffServices, PipelineRunner]:
        decoder, encoder = LatentDecoder(model), ImageEncoder()
        capabilities = dit_capabilities(settings, model)
        adapters = ConditioningAdapters(
            ConditioningOptions(
                special_token_ids=settings.special_token_ids,
                image_token_start_id=settings.image_token_start_id,
                max_sequence_length=settings.max_sequence_length,
                pad_to_multiple=settings.pad_to_multiple,
                dtype=model.facts.dtype,
            )
        )
        policy = OpenFramePolicy(capabilities, adapters, settings.expected_model, settings.expected_final_norm)
        scheduler = RenderScheduler(
            PipelineRunner(model, decoder, encoder, metrics),
            BatchRunner(model, decoder, encoder, metrics),
            admission.run_slots,
            metrics,
            max_batch_size=settings.batch_max_size,
            window=settings.batch_window_ms / 1000,
        )
        results = ResultStream(
            scheduler,
            metrics,
            fatal,
            progress_interval=settings.progress_interval_seconds,
            max_consecutive_failures=settings.max_consecutive_pipeline_failures,
        )
        # The warm-up must not show up as served traffic.
        warmup_runner = PipelineRunner(model, decoder, encoder, DitMetrics(CollectorRegistry()))
        served = HandoffServices(capabilities=capabilities, policy=policy, adapters=adapters, results=results)
        return served, warmup_runner

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(state.load(load_model, serve))
        try:
            yield
        finally:
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loading

    # A handoff's trace context travels in its open frame (dit_service/handoff_trace.py), not in headers.
    app = create_app(
        "ardit DiT service",
        lifespan=lifespan,
        readiness=state.readiness,
        registry=registry,
        app_metrics=metrics.app,
        untraced_paths=(HANDOFF_PATH,),
    )
    app.state.fatal = fatal
    endpoint = HandoffEndpoint(
        handoff_auth(settings.handoff_token),
        admission,
        HandoffIntake(
            settings.assembly_caps,
            settings.frame_limits,
            settings.stall_timeout_seconds,
            settings.handoff_deadline_seconds,
            metrics,
            RowBufferPool(settings.idle_row_buffer_bytes) if settings.idle_row_buffer_bytes else None,
        ),
        state.require,
        metrics,
    )
    app.add_api_route(
        HANDOFF_PATH,
        endpoint,
        methods=["POST"],
        response_class=StreamingResponse,
        summary="Receive one request's hidden rows; answer with its images (shared/HANDOFF_SPEC.md)",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {HANDOFF_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
            }
        },
        responses={
            200: {
                "description": "Result frames (msgpack): progress, partial images, images, done or error.",
                "content": {RESULT_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
            },
            **error_responses(400, 401, 408, 409, 413, 415, 422, 429, 503),
        },
    )
    return app


def handoff_auth(token: SecretStr | None) -> BearerAuth:
    """The internal token both services share (``ARDIT_HANDOFF_TOKEN``)."""
    tokens = [token.get_secret_value()] if token is not None else []
    return BearerAuth(
        tokens, what="handoff token", missing_code="invalid_handoff_token", invalid_code="invalid_handoff_token"
    )
