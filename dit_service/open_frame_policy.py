"""What an ``open`` frame must ask for before this DiT accepts the rest of the handoff.

Checked as soon as ``open`` arrives, so a handoff this model cannot serve ends before its rows
are sent. The limits are the ones this DiT announces (``DitCapabilities``): the AR checks public
requests against the announcement, and this check is what makes the DiT safe whoever sends.
Sizes are checked because diffusers would silently round them down, and the conditioning width
because a mismatch would only surface as a matmul error mid-run. Rejections name the public API's
parameters (``size``, ``n``, ...), so the AR can pass them through unchanged.
"""

from __future__ import annotations

import math

from dit_service.conditioning import PUBLIC_PARAM, ConditioningAdapter, ConditioningAdapters
from dit_service.errors import ConditioningMismatch, InvalidDiffusionParams
from shared.capabilities import DitCapabilities
from shared.frames import MAX_SEED, DiffusionParams, OpenFrame


class OpenFramePolicy:
    def __init__(
        self,
        capabilities: DitCapabilities,
        adapters: ConditioningAdapters,
        expected_model: str | None,
        expected_final_norm: bool | None,
    ) -> None:
        self._capabilities = capabilities
        self._adapters = adapters
        self._expected_model = expected_model
        self._expected_final_norm = expected_final_norm

    def check(self, frame: OpenFrame) -> ConditioningAdapter:
        if self._expected_model is not None and frame.model != self._expected_model:
            raise ConditioningMismatch(
                f"hidden states come from {frame.model!r}; this DiT is paired with {self._expected_model!r}",
                param="model",
            )
        adapter = self._adapters.get(frame.conditioning)
        if frame.hidden_size != self._capabilities.hidden_size:
            raise ConditioningMismatch(
                f"hidden_size {frame.hidden_size} does not match the DiT's joint_attention_dim "
                f"{self._capabilities.hidden_size}",
                param="hidden_size",
            )
        if self._expected_final_norm is not None and frame.final_norm != self._expected_final_norm:
            state = "after" if self._expected_final_norm else "before"
            raise ConditioningMismatch(
                f"this DiT is conditioned on hidden states {state} the AR model's final norm", param="final_norm"
            )
        for name, spec in frame.streams.items():
            if spec.prefix_tokens is None:
                # Without it the template's rows would silently condition the image.
                raise ConditioningMismatch(
                    f"open.streams.{name}.prefix_tokens is required: this DiT never conditions on the AR's "
                    "prompt template",
                    param=PUBLIC_PARAM[name],
                )
        self._check_diffusion(frame.diffusion, has_uncond="uncond" in frame.streams)
        return adapter

    def _check_diffusion(self, params: DiffusionParams, has_uncond: bool) -> None:
        limits = self._capabilities.limits
        multiple = limits.size_multiple
        size = f"{params.width}x{params.height}"
        if params.width % multiple or params.height % multiple:
            raise InvalidDiffusionParams(f"size {size}: width and height must be multiples of {multiple}", param="size")
        if params.width * params.height > limits.max_pixels:
            raise InvalidDiffusionParams(f"size {size} is over {limits.max_pixels} pixels", param="size")
        steps, fewest = params.num_inference_steps, limits.min_inference_steps
        if not fewest <= steps <= limits.max_inference_steps:
            raise InvalidDiffusionParams(
                f"num_inference_steps {steps} is not within [{fewest}, {limits.max_inference_steps}]",
                param="num_inference_steps",
            )
        if params.num_images > limits.max_images:
            raise InvalidDiffusionParams(f"n {params.num_images} is over {limits.max_images}", param="n")
        if params.seed + params.num_images - 1 > MAX_SEED:
            # Image i uses seed + i; a torch generator takes at most a uint64.
            raise InvalidDiffusionParams(f"seed {params.seed} + n - 1 is over {MAX_SEED}", param="seed")
        guidance = params.guidance_scale
        if not math.isfinite(guidance) or guidance > limits.max_guidance_scale:
            raise InvalidDiffusionParams(
                f"guidance_scale {guidance} is not within [0, {limits.max_guidance_scale}]", param="guidance_scale"
            )
        if guidance > 1.0 and not has_uncond:
            # diffusers would quietly render without guidance; CFG needs the AR's negative stream.
            raise InvalidDiffusionParams(
                f"guidance_scale {guidance} > 1 needs the 'uncond' stream (negative prompt rows)",
                param="guidance_scale",
            )
        if params.output_format not in limits.output_formats:
            raise InvalidDiffusionParams(
                f"output_format {params.output_format!r} is not supported here", param="output_format"
            )
