"""What serves handoffs once the model is loaded, built in one place from the settings and the model.

``serve_model`` is what ``ModelState`` calls after the load: the announcement (capabilities), the
open-frame policy (which holds the conditioning adapters) and the result stream over the renderer, plus the warm-up:
a second renderer with throwaway metrics (the warm-up must not show up as served traffic), and the
default request and the steps it may take, what the DiT's pace is measured on.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from dit_service.admission import AdmissionControl
from dit_service.capabilities import dit_capabilities
from dit_service.conditioning import ConditioningAdapters, ConditioningOptions
from dit_service.family_classes import LATENT_DECODERS
from dit_service.image_encoder import ImageEncoder
from dit_service.metrics import DitMetrics
from dit_service.model import DitModel
from dit_service.model_state import Warmup
from dit_service.open_frame_policy import OpenFramePolicy
from dit_service.render_scheduler import RenderScheduler
from dit_service.renderer import Renderer
from dit_service.result_stream import ResultStream
from dit_service.settings import DitSettings
from services.fatal import Fatal
from services.heap import IdleRelease
from shared.capabilities import DitCapabilities


@dataclass(frozen=True)
class HandoffServices:
    """What serving a handoff needs once the model is loaded."""

    capabilities: DitCapabilities
    policy: OpenFramePolicy
    results: ResultStream


def serve_model(
    settings: DitSettings,
    model: DitModel,
    metrics: DitMetrics,
    admission: AdmissionControl,
    fatal: Fatal,
    idle: IdleRelease,
) -> tuple[HandoffServices, Warmup]:
    """The services over ``model``, and its warm-up."""
    # What decodes the family's latents here (previews; Qwen-Image's finals and edits too), where it has one.
    layout = model.card.latents
    vae, encoder = LATENT_DECODERS[layout](model.vae) if layout is not None else None, ImageEncoder()
    capabilities = dit_capabilities(settings, model)
    options = ConditioningOptions(
        special_token_ids=settings.special_token_ids,
        image_token_start_id=settings.image_token_start_id,
        max_sequence_length=settings.conditioning_rows(model.card),
        pad_to_multiple=settings.pad_to_multiple,
        dtype=model.facts.dtype,
    )
    scheduler = RenderScheduler(
        Renderer(model, vae, encoder, metrics),
        admission.run_slots,
        metrics,
        max_batch_size=settings.batch_max_size,
        window=settings.batch_window_ms / 1000,
        idle=idle,
    )
    results = ResultStream(
        scheduler,
        metrics,
        fatal,
        progress_interval=settings.progress_interval_seconds,
        max_consecutive_failures=settings.max_consecutive_pipeline_failures,
    )
    policy = OpenFramePolicy(capabilities, ConditioningAdapters(options), settings.expected_model)
    limits = capabilities.limits
    warmup = Warmup(
        Renderer(model, vae, encoder, DitMetrics(CollectorRegistry())),
        capabilities.default_params(),
        limits.min_inference_steps,
        limits.max_inference_steps,
    )
    return HandoffServices(capabilities, policy, results), warmup
