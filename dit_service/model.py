"""The loaded model's components, shared by every request, and per-request pipelines over them.

One diffusers pipeline object is not thread-safe (its scheduler holds the step index and its
``_interrupt``/``_guidance_scale`` live on the object), but the weights are read-only during
inference. So the weights are loaded once, by the pipeline of the family's first render (its model card's
``loading_pipeline``: text to image, else its edit's; ``services.model_card``), without the text side (the AR
reads the text and, for an edit model, the pictures), and each request gets a fresh pipeline object over the same
transformer and VAE with its own scheduler built from the shared config: text to image, or an edit where
the family edits (Qwen-Image's ``QwenImageImg2ImgPipeline``, ``QwenImageInpaintPipeline`` with a mask;
Qwen-Image-Edit's ``QwenImageEditPlusPipeline``) — the same components driven the way diffusers' own
pipelines drive them.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from dit_service.family_classes import pipeline_class
from dit_service.shared_vae import SharedVae
from services.model_card import ModelCard, PipelineKind
from shared.tensor_codec import ALLOWED_DTYPES

log = logging.getLogger("ardit.dit.model")


@dataclass(frozen=True)
class ModelFacts:
    """What request validation needs to know about the loaded model."""

    # The width of the rows the family's transformer takes (its card's ``row_width_key``).
    row_width: int
    # Pixel sizes must be multiples of this, or diffusers silently rounds them down (ZImagePipeline raises).
    size_multiple: int
    # Qwen-Image's scheduler stretches sigmas to ``shift_terminal``; a 1-step schedule divides 0 by 0
    # there and renders NaN, so such a model needs at least 2 steps.
    min_inference_steps: int
    dtype: torch.dtype
    device: torch.device


# diffusers registers a pipeline's components at run time (``register_modules``), so to a type
# checker ``transformer``, ``vae``, ``scheduler``... are not attributes of a pipeline class.
Pipeline = Any
# The components that read the prompt (and an edit model's pictures): the AR's, never loaded here.
TEXT_SIDE = ("text_encoder", "tokenizer", "processor")


def _without_text_side(pipeline: type[Any], processor: Any = None) -> dict[str, Any]:
    """None for each text-side component ``pipeline`` takes (Qwen-Image-Edit's takes a processor too), but
    ``processor`` where one is given (a pipeline that reads it when built: ``ModelCard.pipeline_needs_processor``)."""
    parts: dict[str, Any] = {name: None for name in TEXT_SIDE if name in inspect.signature(pipeline).parameters}
    if processor is not None:
        parts["processor"] = processor
    return parts


class DitModel:
    def __init__(self, base: Pipeline, device: torch.device, dtype: torch.dtype, card: ModelCard) -> None:
        self._base = base
        self.card = card
        self.transformer = base.transformer
        self.vae = SharedVae(base.vae, base.vae_scale_factor)
        self.facts = ModelFacts(
            row_width=int(base.transformer.config[card.row_width_key]),
            size_multiple=base.vae_scale_factor * 2,
            min_inference_steps=2 if base.scheduler.config.get("shift_terminal") else 1,
            dtype=dtype,
            device=device,
        )

    @classmethod
    def load(cls, model_dir: Path, device: str, dtype_name: str) -> DitModel:
        dtype = ALLOWED_DTYPES[dtype_name]
        card = ModelCard.read(model_dir)  # before the weights: a card naming layers the folder lacks fails at once
        pipeline = pipeline_class(card.loading_pipeline)
        text_side = _without_text_side(pipeline)
        if card.pipeline_needs_processor:
            del text_side["processor"]  # diffusers loads it from the folder's processor/
        base = pipeline.from_pretrained(str(model_dir), **text_side, dtype=dtype)
        base.to(device)
        log.info("loaded %s (%s) on %s as %s", model_dir, card.family, device, dtype_name)
        return cls(base, torch.device(device), dtype, card)

    def new_pipeline(self, kind: PipelineKind = "text_to_image") -> Pipeline:
        options = {name: self._base.config[name] for name in self.card.pipeline_options}
        kind_class = pipeline_class(self.card.pipelines[kind])
        pipeline: Pipeline = kind_class(
            scheduler=FlowMatchEulerDiscreteScheduler.from_config(self._base.scheduler.config),
            vae=self.vae.encoding_under_lock() if kind == "reference_edit" else self.vae.module,
            transformer=self.transformer,
            **_without_text_side(kind_class, self._base.processor if self.card.pipeline_needs_processor else None),
            **options,
        )
        pipeline.set_progress_bar_config(disable=True)
        return pipeline
