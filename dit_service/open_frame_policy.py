"""What an ``open`` frame must ask for before this DiT accepts the rest of the handoff.

Checked as soon as ``open`` arrives, so a handoff this model cannot serve ends before its rows
are sent. The diffusion parameters are checked against the limits this DiT announces, by the same
``DiffusionLimits.check`` the AR runs on public requests: the announcement lets the AR refuse
early, this check makes the DiT safe whoever sends. The conditioning width is checked because a
mismatch would only surface as a matmul error mid-run; the recipe's layers, final norm and adapter (where the
model's card names them) because rows read otherwise have the same width and would render a wrong picture without
any error. Rejections name the public API's parameters (``size``, ``n``, ...), so the AR can pass them through
unchanged.
"""

from __future__ import annotations

from dit_service.conditioning import ConditioningAdapter, ConditioningAdapters
from shared.capabilities import DitCapabilities
from shared.errors import ConditioningMismatch, InvalidDiffusionParams
from shared.frames import PUBLIC_PARAM, OpenFrame


class OpenFramePolicy:
    def __init__(
        self,
        capabilities: DitCapabilities,
        adapters: ConditioningAdapters,
        expected_model: str | None,
    ) -> None:
        self._capabilities = capabilities
        self._adapters = adapters
        self._expected_model = expected_model

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
        rows = self._capabilities.rows
        if rows is None and len(frame.layers) > 1:
            raise ConditioningMismatch(
                f"rows of layers {frame.layers}: this DiT knows no recipe of several layers", param="layers"
            )
        if rows is not None and frame.layers != rows.layers:
            raise ConditioningMismatch(
                f"hidden states come from the AR's layers {frame.layers}; this DiT was trained on layers {rows.layers}",
                param="layers",
            )
        if rows is not None and frame.final_norm != rows.final_norm:
            state = "after" if rows.final_norm else "before"
            raise ConditioningMismatch(
                f"this DiT is conditioned on hidden states {state} the AR model's final norm", param="final_norm"
            )
        if rows is not None and frame.conditioning != rows.conditioning:
            raise ConditioningMismatch(
                f"this DiT is conditioned by its {rows.conditioning!r} adapter, not {frame.conditioning!r}",
                param="conditioning",
            )
        for name, spec in frame.streams.items():
            if spec.prefix_tokens is None:
                # Without it the template's rows would silently condition the image.
                raise ConditioningMismatch(
                    f"open.streams.{name}.prefix_tokens is required: this DiT never conditions on the AR's "
                    "prompt template",
                    param=PUBLIC_PARAM[name],
                )
        params = frame.diffusion
        self._capabilities.limits.check(params)
        if params.cfg_above != self._capabilities.cfg_above:
            # The sender guided by another family's rule: it would send negative rows this pipeline ignores, or
            # none where it runs CFG.
            raise InvalidDiffusionParams(
                f"guidance runs above {self._capabilities.cfg_above} here, not above {params.cfg_above}",
                param="guidance_scale",
            )
        if frame.edit is not None and not self._capabilities.limits.edits:
            raise InvalidDiffusionParams("this image model does not edit images", param="image")
        if params.cfg and "uncond" not in frame.streams:
            # diffusers would quietly render without guidance; CFG needs the AR's negative stream.
            raise InvalidDiffusionParams(
                f"guidance_scale {params.guidance_scale} > 1 needs the 'uncond' stream (negative prompt rows)",
                param="guidance_scale",
            )
        return adapter
