"""The warm-up's pace: three timed renders split into seconds a request, a megapixel and a unit of denoising."""

from __future__ import annotations

import pytest

from dit_service.model_state import split_pace
from shared.capabilities import Load, Pace

TRUE = Pace(per_request=0.02, per_megapixel=6.0, per_work=0.06)
SMALLEST = Load(1, 0.000256, 0.000256)  # 16x16, one step, no CFG
FEWER = Load(1, 0.065536, 0.131072)  # 256x256 with CFG, one step
MORE = Load(1, 0.065536, 0.655360)  # the same in five


def took(load: Load, pace: Pace = TRUE) -> tuple[float, Load]:
    return pace.seconds(load), load


def test_renders_that_cost_by_the_parts_are_split_into_those_parts():
    pace = split_pace(took(SMALLEST), took(FEWER), took(MORE))
    assert (pace.per_request, pace.per_megapixel, pace.per_work) == pytest.approx((0.02, 6.0, 0.06))


def test_a_vae_heavy_model_is_not_priced_as_if_its_vae_were_denoising():
    """Steps that cost little next to the VAE: a large request of many steps costs its steps at their own price,
    not at what the default request's total divided by its work would say (ten times more, here)."""
    pace = split_pace(took(SMALLEST), took(FEWER), took(MORE))
    large = Load(1, 1.048576, 209.7152)  # 1024x1024, 100 steps, CFG
    by_total = TRUE.seconds(FEWER) / FEWER.work * large.work
    assert pace.seconds(large) == pytest.approx(TRUE.seconds(large))
    assert by_total > 10 * pace.seconds(large)


def test_noise_that_makes_more_steps_look_faster_prices_the_steps_at_nothing_not_below():
    fewer_seconds, _ = took(FEWER)
    pace = split_pace(took(SMALLEST), took(FEWER), (fewer_seconds - 0.01, MORE))
    assert pace.per_work == 0.0 and pace.per_megapixel > 0


def test_a_model_whose_step_count_is_fixed_carries_its_steps_in_the_megapixels():
    pace = split_pace(took(SMALLEST), took(FEWER), took(FEWER))
    assert pace.per_work == 0.0
    assert pace.seconds(FEWER) == pytest.approx(TRUE.seconds(FEWER))
