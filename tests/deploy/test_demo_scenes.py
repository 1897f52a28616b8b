"""deploy/checkpoints/demo_scenes.py: held-out pairs are out of the training set, and a seed fixes the pictures."""

from __future__ import annotations

import random

from deploy.checkpoints.demo_scenes import (
    COLOURS,
    HELD_OUT_PAIRS,
    SHAPES,
    all_attributes,
    draw,
    held_out_attributes,
    random_scene,
    seen_attributes,
    wordings,
)


def test_held_out_pairs_are_never_seen_but_their_words_are():
    seen = seen_attributes()
    assert {(a.colour, a.shape) for a in seen}.isdisjoint(HELD_OUT_PAIRS)
    assert len(seen) + len(held_out_attributes()) == len(all_attributes()) == 3 * 6 * 5 * 4
    for colour, shape in HELD_OUT_PAIRS:
        assert any(a.colour == colour for a in seen) and any(a.shape == shape for a in seen)
    assert {a.shape for a in seen} == set(SHAPES) and {a.colour for a in seen} == set(COLOURS)


def test_every_wording_names_both_colours():
    for attributes in all_attributes()[::37]:
        for text in wordings(attributes):
            assert attributes.colour in text and attributes.background in text


def test_a_wording_without_the_shapes_colour_still_names_the_shape_the_background_and_the_place():
    for attributes in all_attributes()[::37]:
        with_colour, without = wordings(attributes), wordings(attributes, shape_colour=False)
        assert len(without) == len(with_colour)
        for text in without:
            assert attributes.colour not in text and attributes.background in text, text
            assert attributes.column in text and "  " not in text, text


def test_a_seed_fixes_the_picture():
    def picture(seed: int) -> bytes:
        rng = random.Random(seed)
        return draw(random_scene(rng.choice(all_attributes()), rng)).tobytes()

    assert picture(3) == picture(3) != picture(4)
