"""The demo model's captions: each picture's placed wordings name its quarter (the grammar's, then a share from
the eight templates), and its unplaced ones name no place and are shared by its four quarters, so a caption
without a place leaves the quarter to chance."""

from __future__ import annotations

import re

import pytest

from deploy.checkpoints import demo_scenes, prompt_grammar
from deploy.checkpoints.train_demo_dit import draw_wordings

COMBINATIONS = demo_scenes.seen_attributes()
PLACE_WORDS = re.compile(r"\b(top|upper|bottom|lower|left|right)\b", re.IGNORECASE)


@pytest.fixture(scope="module")
def wordings():
    return draw_wordings(COMBINATIONS, seed=0, placed=4, unplaced=3, templated=1)


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


def test_the_wordings_are_a_function_of_the_seed(wordings):
    assert draw_wordings(COMBINATIONS, seed=0, placed=4, unplaced=3, templated=1).texts == wordings.texts
    assert draw_wordings(COMBINATIONS, seed=1, placed=4, unplaced=3, templated=1).texts != wordings.texts
