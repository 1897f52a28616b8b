"""What an ``open`` frame must ask for before this DiT accepts the rest of the handoff.

Checked as soon as ``open`` arrives, so a handoff this model cannot serve ends before its rows
are sent. Sizes are checked here because diffusers would silently round them down, and the
conditioning width because a mismatch would only surface as a matmul error mid-run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dit_service.conditioning import ConditioningAdapter, ConditioningAdapters
from dit_service.errors import ConditioningMismatch, InvalidDiffusionParams
from dit_service.image_encoder import ImageEncoder
from dit_service.model import ModelFacts
from shared.frames import DiffusionParams, OpenFrame


@dataclass(frozen=True)
class DiffusionLimits:
    max_pixels: int
    max_inference_steps: int
    max_images: int
    max_guidance_scale: float


class OpenFramePolicy:
    def __init__(
        self,
        facts: ModelFacts,
        adapters: ConditioningAdapters,
        limits: DiffusionLimits,
        expected_model: str | None,
        expected_final_norm: bool | None,
    ) -> None:
        self._facts = facts
        self._adapters = adapters
        self._limits = limits
        self._expected_model = expected_model
        self._expected_final_norm = expected_final_norm

    def check(self, frame: OpenFrame) -> ConditioningAdapter:
        if self._expected_model is not None and frame.model != self._expected_model:
            raise ConditioningMismatch(
                f"hidden states come from {frame.model!r}; this DiT is paired with {self._expected_model!r}",
                param="model",
            )
        adapter = self._adapters.get(frame.conditioning)
        if frame.hidden_size != self._facts.joint_attention_dim:
            raise ConditioningMismatch(
                f"hidden_size {frame.hidden_size} does not match the DiT's joint_attention_dim "
                f"{self._facts.joint_attention_dim}",
                param="hidden_size",
            )
        if self._expected_final_norm is not None and frame.final_norm != self._expected_final_norm:
            state = "after" if self._expected_final_norm else "before"
            raise ConditioningMismatch(
                f"this DiT is conditioned on hidden states {state} the AR model's final norm", param="final_norm"
            )
        self._check_diffusion(frame.diffusion, has_uncond="uncond" in frame.streams)
        return adapter

    def _check_diffusion(self, params: DiffusionParams, has_uncond: bool) -> None:
        limits, multiple = self._limits, self._facts.size_multiple
        for name, value in (("width", params.width), ("height", params.height)):
            if value % multiple:
                raise InvalidDiffusionParams(
                    f"{name} {value} is not a multiple of {multiple}", param=f"diffusion.{name}"
                )
        if params.width * params.height > limits.max_pixels:
            raise InvalidDiffusionParams(
                f"{params.width}x{params.height} is over {limits.max_pixels} pixels", param="diffusion.width"
            )
        steps, fewest = params.num_inference_steps, self._facts.min_inference_steps
        if not fewest <= steps <= limits.max_inference_steps:
            raise InvalidDiffusionParams(
                f"num_inference_steps {steps} is not within [{fewest}, {limits.max_inference_steps}]",
                param="diffusion.num_inference_steps",
            )
        if params.num_images > limits.max_images:
            raise InvalidDiffusionParams(
                f"num_images {params.num_images} is over {limits.max_images}", param="diffusion.num_images"
            )
        guidance = params.guidance_scale
        if not math.isfinite(guidance) or guidance > limits.max_guidance_scale:
            raise InvalidDiffusionParams(
                f"guidance_scale {guidance} is not within [0, {limits.max_guidance_scale}]",
                param="diffusion.guidance_scale",
            )
        if guidance > 1.0 and not has_uncond:
            # diffusers would quietly render without guidance; CFG needs the AR's negative stream.
            raise InvalidDiffusionParams(
                f"guidance_scale {guidance} > 1 needs the 'uncond' stream (negative prompt rows)",
                param="diffusion.guidance_scale",
            )
        if not ImageEncoder.supports(params.output_format):
            raise InvalidDiffusionParams(
                f"output_format {params.output_format!r} is not supported here", param="diffusion.output_format"
            )
