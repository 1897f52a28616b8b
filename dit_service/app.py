"""The DiT service's composition root: settings in, FastAPI app out."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import torch
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from dit_service import __version__
from dit_service.admission import AdmissionControl
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
from dit_service.result_stream import ResultStream
from dit_service.settings import DitSettings
from services.app import create_app
from services.auth import BearerAuth
from services.metrics import new_registry
from shared.row_buffer_pool import RowBufferPool


def create_dit_app(settings: DitSettings, registry: CollectorRegistry | None = None) -> FastAPI:
    registry = registry if registry is not None else new_registry()
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
        settings.retry_after_seconds, lambda served: {"capabilities": served.capabilities.model_dump(mode="json")}
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
        results = ResultStream(PipelineRunner(model, decoder, encoder, metrics), admission.run_slots, metrics)
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
    endpoint = HandoffEndpoint(
        handoff_auth(settings.handoff_token),
        admission,
        HandoffIntake(
            settings.assembly_caps,
            settings.frame_limits,
            settings.stall_timeout_seconds,
            metrics,
            RowBufferPool(settings.idle_row_buffer_bytes) if settings.idle_row_buffer_bytes else None,
        ),
        state.require,
        metrics,
    )
    app.add_api_route(HANDOFF_PATH, endpoint, methods=["POST"], include_in_schema=False)
    return app


def handoff_auth(token: SecretStr | None) -> BearerAuth:
    """The internal token both services share (``ARDIT_HANDOFF_TOKEN``)."""
    tokens = [token.get_secret_value()] if token is not None else []
    return BearerAuth(
        tokens, what="handoff token", missing_code="invalid_handoff_token", invalid_code="invalid_handoff_token"
    )
