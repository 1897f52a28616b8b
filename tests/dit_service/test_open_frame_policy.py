"""dit_service/open_frame_policy.py: an ``open`` whose rows are read otherwise than the model's card says (other
layers, the other side of the final norm, another adapter) is refused before any row is sent, naming the part; a
card that names no recipe takes rows of any one layer."""

from __future__ import annotations

import pytest
import torch

from dit_service.conditioning import ConditioningAdapters, ConditioningOptions
from dit_service.open_frame_policy import OpenFramePolicy
from shared.errors import ConditioningMismatch, InvalidDiffusionParams
from shared.frames import OpenFrame
from shared.row_recipe import RowRecipe
from tests.dit_service.handoff_requests import open_frame, params
from tests.support.capabilities import DIT

ADAPTERS = ConditioningAdapters(
    ConditioningOptions(
        special_token_ids=frozenset(),
        image_token_start_id=None,
        max_sequence_length=64,
        pad_to_multiple=1,
        dtype=torch.float32,
    )
)


def policy(rows: RowRecipe | None) -> OpenFramePolicy:
    return OpenFramePolicy(DIT.model_copy(update={"rows": rows}), ADAPTERS, expected_model=None)


def frame(*layers: int, final_norm: bool = True, conditioning: str = "qwen_image") -> OpenFrame:
    diffusion = params(width=64, height=48)
    return open_frame(4, diffusion=diffusion, layers=layers, final_norm=final_norm, conditioning=conditioning)


def test_rows_of_the_layer_the_card_names_are_taken():
    assert policy(RowRecipe(layers=[8])).check(frame(8)) is ADAPTERS.get("qwen_image")


def test_rows_of_several_layers_the_card_names_are_taken_in_its_order_only():
    card = RowRecipe(layers=[9, 18, 27], final_norm=False, template=None, conditioning="every_row")
    assert policy(card).check(frame(9, 18, 27, final_norm=False, conditioning="every_row")) is ADAPTERS.get("every_row")
    for layers in ((9, 18), (27, 18, 9), (9, 18, 27, 28)):
        with pytest.raises(ConditioningMismatch) as refused:
            policy(card).check(frame(*layers, final_norm=False, conditioning="every_row"))
        assert refused.value.param == "layers"


def test_rows_of_another_layer_are_a_conditioning_mismatch_naming_both_layers():
    with pytest.raises(ConditioningMismatch) as refused:
        policy(RowRecipe(layers=[8])).check(frame(30))
    assert refused.value.param == "layers"
    assert "[30]" in refused.value.message and "[8]" in refused.value.message


def test_rows_from_the_other_side_of_the_final_norm_are_a_conditioning_mismatch():
    with pytest.raises(ConditioningMismatch) as refused:
        policy(RowRecipe(layers=[8])).check(frame(8, final_norm=False))
    assert refused.value.param == "final_norm"


def test_rows_for_another_adapter_than_the_cards_are_a_conditioning_mismatch():
    with pytest.raises(ConditioningMismatch) as refused:
        policy(RowRecipe(layers=[8])).check(frame(8, conditioning="every_row"))
    assert refused.value.param == "conditioning" and "'qwen_image'" in refused.value.message


def test_an_open_guided_by_another_familys_rule_is_refused_naming_guidance_scale():
    zero = open_frame(4, diffusion=params(width=64, height=48, cfg_above=0.0), layers=(8,))
    with pytest.raises(InvalidDiffusionParams) as refused:
        policy(RowRecipe(layers=[8])).check(zero)
    assert refused.value.param == "guidance_scale" and "above 1.0" in refused.value.message


def test_a_card_that_names_no_recipe_takes_rows_of_any_one_layer_on_either_side_of_the_norm_but_not_of_several():
    assert policy(None).check(frame(30)) is ADAPTERS.get("qwen_image")
    assert policy(None).check(frame(3, final_norm=False)) is ADAPTERS.get("qwen_image")
    with pytest.raises(ConditioningMismatch) as refused:
        policy(None).check(frame(9, 18))
    assert refused.value.param == "layers"
