"""The demo model's captions: each picture's placed wordings name its quarter (the grammar's, then a share from
the eight templates), its unplaced ones name no place and are shared by its four quarters, so a caption
without a place leaves the quarter to chance, and its uncoloured ones leave the shape's colour unsaid and are
shared by every colour of its shape, background and quarter. Its loss weighs the latent values the shape covers
more. The committed model was trained on the AR layer the AR streams by default."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from ar_service.engine.text_model import TextModel
from ar_service.settings import DEMO_HIDDEN_LAYER, ArSettings
from deploy.checkpoints import demo_scenes, prompt_grammar
from deploy.checkpoints.train_demo_dit import VAE_Z_DIM, Scenes, draw_wordings, loss_weights, pack, text_colours
from services.model_card import ModelCard

COMBINATIONS = demo_scenes.seen_attributes()
PLACE_WORDS = re.compile(r"\b(top|upper|bottom|lower|left|right)\b", re.IGNORECASE)


@pytest.fixture(scope="module")
def wordings():
    return draw_wordings(COMBINATIONS, seed=0, placed=4, unplaced=3, templated=1, uncoloured=3)


def test_every_combination_has_its_own_placed_wordings_that_name_its_quarter(wordings):
    assert wordings.placed.shape == (len(COMBINATIONS), 4)
    assert len(set(wordings.placed.flatten().tolist())) == wordings.placed.numel()
    for asked, ids in zip(COMBINATIONS, wordings.placed.tolist(), strict=True):
        rows = prompt_grammar.ROW_WORDS[asked.row]
        for text in (wordings.texts[i].lower() for i in ids):
            assert asked.column in text and any(row in text for row in rows), text


def test_the_templated_share_of_the_placed_wordings_comes_from_the_eight_templates(wordings):
    for asked, ids in zip(COMBINATIONS, wordings.placed.tolist(), strict=True):
        templated = set(demo_scenes.wordings(asked))
        assert [wordings.texts[i] in templated for i in ids] == [False, False, False, True]


def test_unplaced_wordings_name_no_place_and_are_the_same_for_the_four_quarters_of_a_picture(wordings):
    by_picture: dict[tuple[str, str, str], set[tuple[int, ...]]] = {}
    for asked, ids in zip(COMBINATIONS, wordings.unplaced.tolist(), strict=True):
        by_picture.setdefault((asked.shape, asked.colour, asked.background), set()).add(tuple(ids))
        assert not any(PLACE_WORDS.search(wordings.texts[i]) for i in ids), [wordings.texts[i] for i in ids]
    assert len(by_picture) == len(COMBINATIONS) // 4
    assert all(len(shared) == 1 for shared in by_picture.values())
    assert len({ids for shared in by_picture.values() for ids in shared}) == len(by_picture)


def test_uncoloured_wordings_name_the_quarter_and_the_background_and_are_the_same_for_every_shape_colour(wordings):
    by_picture: dict[tuple[str, str, str, str], set[tuple[int, ...]]] = {}
    for asked, ids in zip(COMBINATIONS, wordings.uncoloured.tolist(), strict=True):
        by_picture.setdefault((asked.shape, asked.background, asked.row, asked.column), set()).add(tuple(ids))
        for text in (wordings.texts[i].lower() for i in ids):
            assert asked.column in text and any(w in text for w in prompt_grammar.COLOUR_WORDS[asked.background])
            assert not any(w in text for w in prompt_grammar.COLOUR_WORDS[asked.colour]), text
    assert len(by_picture) == 3 * 6 * 4
    assert all(len(shared) == 1 for shared in by_picture.values())
    templated = {
        key: set(demo_scenes.wordings(asked, shape_colour=False))
        for asked in COMBINATIONS
        for key in [(asked.shape, asked.background, asked.row, asked.column)]
    }
    for key, (ids,) in by_picture.items():
        assert [wordings.texts[i] in templated[key] for i in ids] == [False, False, True]


def test_each_wording_that_names_the_shapes_colour_is_known_by_its_shape_and_background_colour(wordings):
    colours = text_colours(wordings, COMBINATIONS)
    for asked, placed, unplaced in zip(COMBINATIONS, wordings.placed.tolist(), wordings.unplaced.tolist(), strict=True):
        assert all(colours[i] == (asked.colour, asked.background) for i in placed + unplaced)
    assert all(colours[i] is None for i in wordings.uncoloured.flatten().tolist())


def test_uncoloured_wordings_leave_every_other_wording_of_the_seed_as_it_was(wordings):
    without = draw_wordings(COMBINATIONS, seed=0, placed=4, unplaced=3, templated=1)
    assert wordings.texts[: len(without.texts)] == without.texts
    assert torch.equal(wordings.placed, without.placed) and torch.equal(wordings.unplaced, without.unplaced)
    assert without.uncoloured.shape == (len(COMBINATIONS), 0)


def test_the_wordings_are_a_function_of_the_seed(wordings):
    assert draw_wordings(COMBINATIONS, seed=0, placed=4, unplaced=3, templated=1, uncoloured=3).texts == wordings.texts
    assert draw_wordings(COMBINATIONS, seed=1, placed=4, unplaced=3, templated=1, uncoloured=3).texts != wordings.texts


def test_the_loss_weighs_each_latent_value_by_the_share_of_its_pixels_the_shape_covers():
    asked = demo_scenes.Attributes("square", "black", "white", "top", "right")
    # A 24-pixel square centred at (48, 16) covers x 36-60 and y 4-28: latent pixels (8 pixels a side) 4-7 across
    # and 0-3 down, the middle 2x2 of them whole.
    picture = demo_scenes.draw(demo_scenes.Scene(asked, size=24.0, dx=0.0, dy=0.0))
    pixels = torch.from_numpy(np.array(picture)).permute(2, 0, 1)[None]
    weights = loss_weights(Scenes(pixels, torch.tensor([0]), [asked]), foreground_weight=4.0)
    touched = torch.zeros((1, VAE_Z_DIM, 8, 8), dtype=torch.bool)
    touched[:, :, 0:4, 4:8] = True
    inside = torch.zeros_like(touched)
    inside[:, :, 1:3, 5:7] = True
    assert weights.shape == (1, 16, 4 * VAE_Z_DIM)
    assert torch.equal(weights[pack((~touched).float()).bool()], torch.ones(48 * VAE_Z_DIM))
    assert torch.equal(weights[pack(inside.float()).bool()], torch.full((4 * VAE_Z_DIM,), 5.0))
    edge = weights[pack((touched & ~inside).float()).bool()]
    assert bool(((edge > 1.0) & (edge < 5.0)).all())


def test_the_committed_demo_model_was_trained_on_the_layer_the_ar_streams_by_default():
    committed = Path(__file__).parents[2] / "deploy" / "checkpoints" / "ardit-demo"
    record = json.loads((committed / "training_record.json").read_text())
    language_model_folder = TextModel(Path("smollm2"), Path("smollm2"), "LlamaForCausalLM", 576, 30, text_tower=None)
    assert ArSettings().rows(language_model_folder.card_rows).layers == [DEMO_HIDDEN_LAYER]
    card = ModelCard.read(committed)
    assert card.rows is not None and card.rows.layers == [record["hidden_layer"]] == [DEMO_HIDDEN_LAYER]
