"""The loaded Qwen-Image components, shared by every request, and per-request pipelines over them.

One ``QwenImagePipeline`` object is not thread-safe (its scheduler holds the step index and its
``_interrupt``/``_guidance_scale`` live on the object), but the weights are read-only during
inference. So the weights are loaded once and each request gets a fresh pipeline object over the
same transformer and VAE with its own scheduler built from the shared config: text to image
(``QwenImagePipeline``), or an edit (``QwenImageImg2ImgPipeline``, ``QwenImageInpaintPipeline``
with a mask) — the same components driven the way diffusers' own edit pipelines drive them.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    QwenImageImg2ImgPipeline,
    QwenImageInpaintPipeline,
    QwenImagePipeline,
)

from services.model_card import ModelCard
from shared.tensor_codec import ALLOWED_DTYPES

log = logging.getLogger("ardit.dit.model")


@dataclass(frozen=True)
class ModelFacts:
    """What request validation needs to know about the loaded model."""

    joint_attention_dim: int
    # Pixel sizes must be multiples of this, or diffusers silently rounds them down.
    size_multiple: int
    # Qwen-Image's scheduler stretches sigmas to ``shift_terminal``; a 1-step schedule divides 0 by 0
    # there and renders NaN, so such a model needs at least 2 steps.
    min_inference_steps: int
    dtype: torch.dtype
    device: torch.device


# diffusers registers a pipeline's components at run time (``register_modules``), so to a type
# checker ``transformer``, ``vae``, ``scheduler``... are not attributes of ``QwenImagePipeline``.
Pipeline = Any
PipelineKind = Literal["text_to_image", "image_to_image", "inpaint"]
_PIPELINES: dict[PipelineKind, type] = {
    "text_to_image": QwenImagePipeline,
    "image_to_image": QwenImageImg2ImgPipeline,
    "inpaint": QwenImageInpaintPipeline,
}


class DitModel:
    def __init__(self, base: Pipeline, device: torch.device, dtype: torch.dtype, card: ModelCard) -> None:
        self._base = base
        self.card = card
        self.transformer = base.transformer
        self.vae = base.vae
        # AutoencoderKLQwenImage keeps its causal-conv feature cache on the module itself
        # (clear_cache/_feat_map), so two encodes or decodes at once on the shared VAE corrupt each
        # other: every use of ``vae`` outside a pipeline takes this lock.
        self.vae_lock = threading.Lock()
        self.vae_scale_factor: int = base.vae_scale_factor
        self.facts = ModelFacts(
            joint_attention_dim=int(base.transformer.config.joint_attention_dim),
            size_multiple=base.vae_scale_factor * 2,
            min_inference_steps=2 if base.scheduler.config.get("shift_terminal") else 1,
            dtype=dtype,
            device=device,
        )

    @classmethod
    def load(cls, model_dir: Path, device: str, dtype_name: str) -> DitModel:
        dtype = ALLOWED_DTYPES[dtype_name]
        base = QwenImagePipeline.from_pretrained(str(model_dir), text_encoder=None, tokenizer=None, dtype=dtype)
        base.to(device)
        log.info("loaded %s on %s as %s", model_dir, device, dtype_name)
        return cls(base, torch.device(device), dtype, ModelCard.read(model_dir))

    @property
    def latent_channels(self) -> int:
        # The transformer sees 2x2 patches of VAE latents packed into its channels.
        return int(self.transformer.config.in_channels) // 4

    def new_pipeline(self, kind: PipelineKind = "text_to_image") -> Pipeline:
        pipeline: Pipeline = _PIPELINES[kind](
            scheduler=FlowMatchEulerDiscreteScheduler.from_config(self._base.scheduler.config),
            vae=self.vae,
            text_encoder=None,
            tokenizer=None,
            transformer=self.transformer,
        )
        pipeline.set_progress_bar_config(disable=True)
        return pipeline
