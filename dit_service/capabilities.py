"""This DiT's announcement (``shared.capabilities``), built once from its settings and loaded model.

Every limit comes from one place: the settings (operator's caps) or the model itself (size
multiple, fewest steps, conditioning width, and what its family runs: its model card,
whose guidance cap tightens the operator's; step caches, previews and edits are offered only where
it runs them, text to image only where its pipelines draw from text alone). Defaults follow
settings, then the model card, then fallbacks that suit any Qwen-Image (guidance no higher than
the family's cap). The sizes drawn are the settings' list, else the card's; where either lists
sizes, ``auto`` is the first of them unless a default size is set.
"""

from __future__ import annotations

from dit_service.conditioning import ConditioningAdapters
from dit_service.image_encoder import ImageEncoder
from dit_service.model import DitModel
from dit_service.settings import DitSettings
from shared.capabilities import DiffusionDefaults, DiffusionLimits, DitCapabilities, DitCapacity
from shared.diffusion import MAX_PARTIAL_IMAGES, parse_size
from shared.errors import InvalidDiffusionParams

FALLBACK_SIZE = "256x256"
FALLBACK_STEPS = 8
FALLBACK_GUIDANCE_SCALE = 1.0
FALLBACK_NEGATIVE_PROMPT = " "


def dit_capabilities(settings: DitSettings, model: DitModel) -> DitCapabilities:
    """Raises ``ValueError`` if the configured defaults are outside the limits (a load failure)."""
    facts, card = model.facts, model.card
    limits = _limits(settings, model)
    listed = limits.sizes
    default_size = settings.default_size or card.default_size or (listed[0] if listed else FALLBACK_SIZE)
    width, height = parse_size(default_size)
    capabilities = DitCapabilities(
        model=settings.model_dir.name,
        description=card.description or f"a diffusers {card.family} loaded from {settings.model_dir.name}",
        row_width=facts.row_width,
        rows=card.rows,
        conditioning=ConditioningAdapters.names(),
        cfg_above=card.cfg_above,
        limits=limits,
        defaults=DiffusionDefaults(
            width=width,
            height=height,
            num_inference_steps=settings.default_num_inference_steps
            or card.default_num_inference_steps
            or FALLBACK_STEPS,
            guidance_scale=_first_set(
                settings.default_guidance_scale,
                card.default_guidance_scale,
                fallback=min(FALLBACK_GUIDANCE_SCALE, limits.max_guidance_scale),
            ),
            step_cache=card.default_step_cache
            if card.default_step_cache is not None and card.default_step_cache.method in limits.step_caches
            else None,
            negative_prompt=FALLBACK_NEGATIVE_PROMPT
            if card.default_negative_prompt is None
            else card.default_negative_prompt,
        ),
        capacity=DitCapacity(
            max_concurrent_handoffs=settings.max_concurrent_handoffs,
            max_pipeline_runs=settings.max_pipeline_runs,
            pipeline_queue_size=settings.pipeline_queue_size,
        ),
    )
    _check_defaults(capabilities.defaults, capabilities.limits)
    return capabilities


def _limits(settings: DitSettings, model: DitModel) -> DiffusionLimits:
    facts, card = model.facts, model.card
    # A step cache's hook state lives on the shared transformer: offered, where the family runs them, with one run
    # at a time only.
    step_caches = list(card.step_caches) if settings.max_pipeline_runs == 1 else []
    sizes = card.sizes if settings.sizes is None else settings.sizes
    return DiffusionLimits(
        size_multiple=facts.size_multiple,
        max_pixels=settings.max_pixels,
        min_inference_steps=facts.min_inference_steps,
        max_inference_steps=settings.max_inference_steps,
        max_guidance_scale=min(settings.max_guidance_scale, card.max_guidance_scale),
        max_images=settings.max_images_per_handoff,
        max_conditioning_rows=settings.conditioning_rows(card),
        output_formats=ImageEncoder.supported(),
        step_caches=step_caches,
        sizes=sizes or None,  # [] in the settings: any size, whatever the card lists
        max_partial_images=MAX_PARTIAL_IMAGES if card.previews else 0,
        edits=card.edits,
        text_to_image=card.text_to_image,
        max_edit_pictures=card.max_edit_pictures,
        edit_mask=card.edit_mask,
        edit_strength=card.edit_strength,
        edits_without_steps=card.edits_without_steps,
        reference_pictures=card.reference_pictures,
    )


def _check_defaults(defaults: DiffusionDefaults, limits: DiffusionLimits) -> None:
    for which, size in [
        *(("listed", s) for s in limits.sizes or []),
        ("default", f"{defaults.width}x{defaults.height}"),
    ]:
        try:
            limits.check_size(*parse_size(size))
        except InvalidDiffusionParams as exc:
            raise ValueError(f"{which} size {size}: {exc.message}") from None
    if not limits.min_inference_steps <= defaults.num_inference_steps <= limits.max_inference_steps:
        raise ValueError(f"default steps {defaults.num_inference_steps} outside the model's limits")
    if defaults.guidance_scale > limits.max_guidance_scale:
        raise ValueError(f"default guidance_scale {defaults.guidance_scale} over {limits.max_guidance_scale}")


def _first_set(*values: float | None, fallback: float) -> float:
    return next((v for v in values if v is not None), fallback)
