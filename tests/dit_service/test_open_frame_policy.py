"""dit_service/open_frame_policy.py: an ``open`` whose rows come from another AR layer than the one the
model's card names is refused before any row is sent; a card that names no layer takes any."""

from __future__ import annotations

import pytest
import torch

from dit_service.conditioning import ConditioningAdapters, ConditioningOptions
from dit_service.open_frame_policy import OpenFramePolicy
from shared.errors import ConditioningMismatch
from shared.frames import OpenFrame
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


def policy(hidden_layer: int | None) -> OpenFramePolicy:
    capabilities = DIT.model_copy(update={"hidden_layer": hidden_layer})
    return OpenFramePolicy(capabilities, ADAPTERS, expected_model=None, expected_final_norm=True)


def frame(layer: int) -> OpenFrame:
    return open_frame(4, diffusion=params(width=64, height=48), layer=layer)


def test_rows_of_the_layer_the_card_names_are_taken():
    assert policy(8).check(frame(8)) is ADAPTERS.get("qwen_image")


def test_rows_of_another_layer_are_a_conditioning_mismatch_naming_both_layers():
    with pytest.raises(ConditioningMismatch) as refused:
        policy(8).check(frame(30))
    assert refused.value.param == "layer"
    assert "layer 30" in refused.value.message and "layer 8" in refused.value.message


def test_a_card_that_names_no_layer_takes_rows_of_any():
    assert policy(None).check(frame(30)) is ADAPTERS.get("qwen_image")
