"""deploy/checkpoints/colour_decoys.py: a decoy is its caption with only the shape colour word's rows, and the
opening before them, taken from a sentence that names another colour."""

from __future__ import annotations

import random

import pytest
import torch

from ar_service.settings import DEMO_HIDDEN_LAYER, ArSettings
from deploy.checkpoints import colour_decoys
from deploy.checkpoints.demo_rows import PromptRows
from deploy.checkpoints.prompt_grammar import COLOUR_WORDS
from shared.row_recipe import QWEN_IMAGE_TEMPLATE

TEXTS = [
    "a red circle on a blue background, in the top left",
    "Blue background: paint a royal blue box, upper right",
    "A GRASS-GREEN WEDGE AGAINST BLACK, BOTTOM LEFT",
    "a square on a yellow background, in the top right",
]
COLOURS: list[tuple[str, str] | None] = [("red", "blue"), ("blue", "white"), ("green", "black"), None]


def test_the_colour_word_is_found_whole_and_the_longest_first():
    assert colour_decoys.colour_word_span(TEXTS[0], "red") == (2, 5)
    assert colour_decoys.colour_word_span(TEXTS[1], "blue") == (25, 35)  # "royal blue", not "Blue background"
    assert colour_decoys.colour_word_span(TEXTS[2], "green") == (2, 13)
    assert colour_decoys.colour_word_span(TEXTS[3], "red") is None


def test_a_decoy_word_keeps_the_casing_of_the_word_it_replaces():
    assert colour_decoys.in_the_same_case("emerald", "RED") == "EMERALD"
    assert colour_decoys.in_the_same_case("emerald", "Red") == "Emerald"
    assert colour_decoys.in_the_same_case("emerald", "red") == "emerald"


@pytest.fixture(scope="module")
def encoder() -> PromptRows:
    settings = ArSettings()
    return PromptRows(settings.model_dir, QWEN_IMAGE_TEMPLATE, DEMO_HIDDEN_LAYER)


@pytest.mark.slow
def test_every_text_naming_its_shapes_colour_gets_a_decoy_of_neither_its_shape_nor_its_background_colour(encoder):
    decoys = colour_decoys.plan(encoder, TEXTS, COLOURS, random.Random(0))
    assert [d.text for d in decoys] == [0, 1, 2]
    for decoy in decoys:
        text = TEXTS[decoy.text]
        shape_colour, background = COLOURS[decoy.text] or ("", "")
        start, _ = colour_decoys.colour_word_span(text, shape_colour) or (0, 0)
        assert decoy.opening[:start] == text[:start]
        said = decoy.opening[start:].lower()
        assert any(said in words for c, words in COLOUR_WORDS.items() if c not in (shape_colour, background))
        assert colour_decoys.starts_with_a_vowel(said) == colour_decoys.starts_with_a_vowel(text[start:])


@pytest.mark.slow
def test_decoy_rows_are_the_openings_rows_then_the_texts_rows_after_its_colour_word(encoder):
    decoys = colour_decoys.plan(encoder, TEXTS, COLOURS, random.Random(0))
    text_rows = encoder.rows(TEXTS)
    decoy_rows = colour_decoys.rows(encoder, decoys, text_rows)
    for decoy, rows in zip(decoys, decoy_rows, strict=True):
        text, whole = TEXTS[decoy.text], text_rows[decoy.text]
        shape_colour, _ = COLOURS[decoy.text] or ("", "")
        _, end = colour_decoys.colour_word_span(text, shape_colour) or (0, 0)
        after = whole.shape[0] - decoy.kept_from
        assert torch.equal(rows[-after:], whole[decoy.kept_from :])
        # The decoy sentence's own rows over its opening: the same up to float rounding
        opening = encoder.rows([decoy.opening + text[end:]])[0]
        # (test_demo_rows.py's tolerance: batches of different lengths round differently).
        torch.testing.assert_close(
            rows[: rows.shape[0] - after], opening[: rows.shape[0] - after], atol=1e-4, rtol=1e-5
        )
        # The colour word's rows differ from the text's: the decoy says another colour there.
        assert not torch.allclose(rows[decoy.kept_from - 1], whole[decoy.kept_from - 1], atol=1e-3)
