"""What the DiT is asked to render, on its own: sizes parsed one way, a noise schedule that makes sense."""

from __future__ import annotations

import math
from typing import get_args

import pytest
from pydantic import ValidationError

from shared.diffusion import (
    MAX_SIGMAS,
    STEP_CACHE_METHODS,
    DiffusionParams,
    FirstBlockCache,
    ReferencePictureRules,
    TaylorSeerCache,
    parse_size,
)


def params(**overrides) -> DiffusionParams:
    base = {"width": 64, "height": 48, "num_inference_steps": 3, "guidance_scale": 1.0, "seed": 0}
    return DiffusionParams(**(base | overrides))


def test_sizes_are_width_x_height_in_ascii_digits():
    assert parse_size("1328x1328") == (1328, 1328)
    for size in ("auto", "64", "64x", "1e3x64", "\uff16\uff14x64", "123456x1"):
        with pytest.raises(ValueError):
            parse_size(size)


def test_a_custom_schedule_has_one_strictly_decreasing_noise_level_in_0_1_per_step():
    assert params(sigmas=[1.0, 0.5, 0.1]).sigmas == [1.0, 0.5, 0.1]
    for sigmas in (
        [1.0, 0.5],
        [1.0, 0.5, 0.5],
        [0.5, 1.0, 0.1],
        [1.5, 0.5, 0.1],
        [1.0, 0.5, 0.0],
        [1.0, 0.5, float("nan")],
    ):
        with pytest.raises(ValidationError):
            params(sigmas=sigmas)
    with pytest.raises(ValidationError):
        params(num_inference_steps=MAX_SIGMAS + 1, sigmas=[1 - i / (MAX_SIGMAS + 2) for i in range(MAX_SIGMAS + 1)])


def test_without_a_schedule_the_wire_has_no_sigmas_key():
    assert "sigmas" not in params().model_dump(exclude_none=True)


def test_the_step_cache_methods_are_the_methods_of_the_step_cache_models():
    methods = {get_args(model.model_fields["method"].annotation)[0] for model in (FirstBlockCache, TaylorSeerCache)}
    assert set(STEP_CACHE_METHODS) == methods


def test_a_step_cache_travels_by_its_method_and_its_knob():
    base = {"width": 64, "height": 64, "num_inference_steps": 8, "guidance_scale": 1.0, "seed": 0}
    params = DiffusionParams.model_validate({**base, "step_cache": {"method": "taylorseer", "interval": 3}})
    assert params.step_cache == TaylorSeerCache(method="taylorseer", interval=3)
    assert "step_cache" not in DiffusionParams.model_validate(base).model_dump(exclude_none=True)


def test_cfg_runs_above_the_scale_the_dits_family_guides_from():
    qwen_image = DiffusionParams(width=64, height=64, num_inference_steps=2, guidance_scale=1.0, seed=0)
    assert not qwen_image.cfg and qwen_image.model_copy(update={"guidance_scale": 1.5}).cfg
    z_image = qwen_image.model_copy(update={"guidance_scale": 0.5, "cfg_above": 0.0})
    assert z_image.cfg and not z_image.model_copy(update={"guidance_scale": 0.0}).cfg
    assert z_image.work == 2 * z_image.model_copy(update={"guidance_scale": 0.0}).work


FLUX2_PICTURES = ReferencePictureRules(max_pictures=4, min_side=64, max_aspect=8, max_area=1024 * 1024, multiple=16)


@pytest.mark.parametrize(
    ("size", "why"),
    [((64, 64), None), ((63, 200), "at least 64"), ((64, 513), "at most 8"), ((512, 64), None)],
)
def test_reference_pictures_are_refused_as_flux2s_check_image_input_refuses_them(size, why):
    refusal = FLUX2_PICTURES.refusal(*size)
    assert (refusal is None) if why is None else (why in (refusal or ""))


def test_a_reference_picture_is_drawn_at_its_size_scaled_into_the_area_then_cropped_to_16():
    """Flux2KleinPipeline's own arithmetic: sides scaled by sqrt(area / pixels) and truncated, then floored to 16."""
    assert FLUX2_PICTURES.within_area(96, 70) == (96, 70) and FLUX2_PICTURES.drawn_size(96, 70) == (96, 64)
    scale = math.sqrt(1024 * 1024 / (3000 * 2000))
    assert FLUX2_PICTURES.within_area(3000, 2000) == (int(3000 * scale), int(2000 * scale)) == (1254, 836)
    assert FLUX2_PICTURES.drawn_size(3000, 2000) == (1248, 832)
