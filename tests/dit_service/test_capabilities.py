"""What the DiT announces: its settings' limits, the model's own facts, defaults from settings or card."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dit_service.capabilities import dit_capabilities
from dit_service.model import ModelFacts
from dit_service.settings import DitSettings
from services.model_card import PUBLISHED, QWEN_IMAGE, QWEN_IMAGE_EDIT_PLUS, ModelCard
from shared.diffusion import FirstBlockCache
from shared.row_recipe import RowRecipe

FACTS = ModelFacts(
    row_width=576, size_multiple=16, min_inference_steps=2, dtype=torch.float32, device=torch.device("cpu")
)


# Qwen-Image's card as a folder without its text encoder or an ``ardit.json`` has it: nothing published.
UNPUBLISHED = QWEN_IMAGE.model_copy(update=dict.fromkeys(PUBLISHED))


def published(**fields) -> ModelCard:
    return ModelCard.model_validate(UNPUBLISHED.model_dump() | fields)


def model(card: ModelCard = UNPUBLISHED):
    return SimpleNamespace(facts=FACTS, card=card)


def test_limits_come_from_settings_and_the_model():
    caps = dit_capabilities(DitSettings(max_pixels=65536, max_sequence_length=77, pipeline_queue_size=2), model())
    assert caps.row_width == 576 and caps.conditioning == ["qwen_image", "every_row", "ar_generated"]
    assert (caps.limits.size_multiple, caps.limits.min_inference_steps) == (16, 2)
    assert (caps.limits.max_pixels, caps.limits.max_conditioning_rows) == (65536, 77)
    assert caps.capacity.max_admitted == 1 + 2


def test_defaults_follow_settings_then_the_model_card_then_the_fallback():
    assert (dit_capabilities(DitSettings(), model()).defaults.width, 256) == (256, 256)
    card = published(description="shapes", default_size="64x64", default_num_inference_steps=20)
    caps = dit_capabilities(DitSettings(), model(card))
    assert (caps.description, caps.defaults.width, caps.defaults.num_inference_steps) == ("shapes", 64, 20)
    caps = dit_capabilities(DitSettings(default_size="32x48", default_guidance_scale=3.0), model(card))
    assert (caps.defaults.width, caps.defaults.height, caps.defaults.guidance_scale) == (32, 48, 3.0)


@pytest.mark.parametrize(
    "settings",
    [
        DitSettings(default_size="40x40"),
        DitSettings(default_size="4096x4096"),
        DitSettings(default_num_inference_steps=1),
        DitSettings(default_guidance_scale=60.0),
    ],
)
def test_defaults_the_limits_forbid_fail_the_load(settings):
    with pytest.raises(ValueError):
        dit_capabilities(settings, model())


def test_step_caches_are_offered_and_the_cards_default_announced_only_with_one_run_at_a_time():
    card = published(default_step_cache={"method": "first_block", "threshold": 0.1})
    one_run = dit_capabilities(DitSettings(), model(card))
    assert one_run.limits.step_caches == ["first_block", "taylorseer"]
    assert one_run.defaults.step_cache == FirstBlockCache(method="first_block", threshold=0.1)
    two_runs = dit_capabilities(DitSettings(max_pipeline_runs=2), model(card))
    assert (two_runs.limits.step_caches, two_runs.defaults.step_cache) == ([], None)


def test_the_cards_sizes_are_announced_and_auto_is_the_first_of_them():
    caps = dit_capabilities(DitSettings(), model(published(sizes=["64x64", "128x64"])))
    assert caps.limits.sizes == ["64x64", "128x64"]
    assert (caps.defaults.width, caps.defaults.height) == (64, 64)


def test_the_settings_sizes_replace_the_cards_and_an_empty_list_draws_any_size():
    card = published(default_size="64x64", sizes=["64x64"])
    assert dit_capabilities(DitSettings(sizes=["128x128", "64x64"]), model(card)).limits.sizes == ["128x128", "64x64"]
    anything = dit_capabilities(DitSettings(sizes=[]), model(card))
    assert anything.limits.sizes is None and anything.defaults.width == 64


def test_the_cards_row_recipe_is_announced_and_a_card_without_one_announces_none():
    rows = RowRecipe(layers=[9, 18, 27], final_norm=False, template=None, conditioning="every_row")
    assert dit_capabilities(DitSettings(), model(published(rows=rows))).rows == rows
    assert dit_capabilities(DitSettings(), model()).rows is None


@pytest.mark.parametrize(
    ("card", "announced"),
    [(QWEN_IMAGE, (True, True, 1, True, True)), (QWEN_IMAGE_EDIT_PLUS, (False, True, 3, False, False))],
    ids=["qwen_image", "qwen_image_edit_plus"],
)
def test_what_the_family_draws_from_is_announced_as_its_card_says(card, announced):
    """Qwen-Image: text, or one picture noised to a strength (a mask too); Qwen-Image-Edit: up to three pictures beside
    the rows, no strength, no mask, nothing from text alone."""
    limits = dit_capabilities(DitSettings(), model(card)).limits
    assert (
        limits.text_to_image,
        limits.edits,
        limits.max_edit_pictures,
        limits.edit_mask,
        limits.edit_strength,
    ) == announced


def test_a_model_without_listed_sizes_announces_none():
    assert dit_capabilities(DitSettings(), model()).limits.sizes is None


@pytest.mark.parametrize(
    ("settings", "card"),
    [
        (DitSettings(), published(sizes=["64x64", "40x40"])),  # not a multiple of 16
        (DitSettings(), published(sizes=["4096x4096"])),  # over the pixel limit
        (DitSettings(default_size="128x128"), published(sizes=["64x64"])),  # a default it does not draw
    ],
)
def test_listed_sizes_and_a_default_the_limits_forbid_fail_the_load(settings, card):
    with pytest.raises(ValueError, match="size"):
        dit_capabilities(settings, model(card))
