"""What an ``open`` frame must ask for before this DiT accepts the rest of the handoff.

Checked as soon as ``open`` arrives, before the handoff's memory is allocated, so a handoff this model cannot serve
ends before its rows (or an edit's pictures) are sent. The diffusion parameters are checked against the limits this
DiT announces, by the same ``DiffusionLimits.check`` the AR runs on public requests, and what the request draws from
(text alone, or an edit of so many pictures, a mask, a strength) by ``DiffusionLimits.check_edit``: the announcement
lets the AR refuse early, this check makes the DiT safe whoever sends. The conditioning width is checked because a
mismatch would only surface as a matmul error mid-run; the row recipe (where the model's card names one), by the
recipe's one comparison, field by field, because rows read otherwise have the same width and would render a wrong
picture without any error. Rejections name the public API's parameters (``size``, ``n``, ...), so the AR can pass
them through unchanged.
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
        """The adapter that selects this handoff's rows; a typed refusal for an ``open`` this DiT cannot serve."""
        if self._expected_model is not None and frame.model != self._expected_model:
            raise ConditioningMismatch(
                f"hidden states come from {frame.model!r}; this DiT is paired with {self._expected_model!r}",
                param="model",
            )
        adapter = self._adapters.get(frame.rows.conditioning)
        self._check_rows(frame)
        self._check_diffusion(frame)
        return adapter

    def _check_rows(self, frame: OpenFrame) -> None:
        if frame.row_width != self._capabilities.row_width:
            raise ConditioningMismatch(
                f"rows {frame.row_width} wide do not match the DiT's {self._capabilities.row_width}",
                param="row_width",
            )
        rows = self._capabilities.rows
        if rows is None and len(frame.rows.layers) > 1:
            raise ConditioningMismatch(
                f"rows of layers {frame.rows.layers}: this DiT knows no recipe of several layers", param="layers"
            )
        if rows is not None:
            differences = rows.differences(frame.rows)
            if differences:
                raise ConditioningMismatch(
                    f"the AR reads rows otherwise than this DiT was trained on: {'; '.join(differences.values())}",
                    param=next(iter(differences)),
                )
        for name, spec in frame.streams.items():
            if spec.prefix_tokens is None:
                # Without it the template's rows would silently condition the image.
                raise ConditioningMismatch(
                    f"open.streams.{name}.prefix_tokens is required: this DiT never conditions on the AR's "
                    "prompt template",
                    param=PUBLIC_PARAM[name],
                )

    def _check_diffusion(self, frame: OpenFrame) -> None:
        params, limits = frame.diffusion, self._capabilities.limits
        limits.check(params)
        if params.cfg_above != self._capabilities.cfg_above:
            # The sender guided by another family's rule: it would send negative rows this pipeline ignores, or
            # none where it runs CFG.
            raise InvalidDiffusionParams(
                f"guidance runs above {self._capabilities.cfg_above} here, not above {params.cfg_above}",
                param="guidance_scale",
            )
        limits.check_edit(frame.edit)
        if frame.edit is not None:
            limits.check_edit_steps(frame.edit.strength, params.num_inference_steps)
        if params.cfg and "uncond" not in frame.streams:
            # diffusers would quietly render without guidance; CFG needs the AR's negative stream.
            raise InvalidDiffusionParams(
                f"guidance_scale {params.guidance_scale} runs CFG here (above {params.cfg_above}), which needs the "
                "'uncond' stream (negative prompt rows)",
                param="guidance_scale",
            )
