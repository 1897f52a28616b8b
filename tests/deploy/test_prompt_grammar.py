"""The grammar of prompts: every pattern names what it asks in its own order, with words drawn, and whole
patterns are left out of training."""

from __future__ import annotations

import random

import pytest

from deploy.checkpoints import demo_scenes
from deploy.checkpoints.prompt_grammar import (
    COLOUR_WORDS,
    HELD_OUT_PATTERNS,
    PATTERNS,
    ROW_WORDS,
    SHAPE_WORDS,
    TRAINING_PATTERNS,
    Pattern,
    describe,
)

ASKED = demo_scenes.Attributes("triangle", "yellow", "black", "bottom", "right")


def first_index(text: str, words: tuple[str, ...]) -> int:
    found = [text.find(w) for w in words if w in text]
    assert found, (words, text)
    return min(found)


@pytest.mark.parametrize("pattern", PATTERNS, ids=str)
def test_every_pattern_names_the_shape_its_colour_the_background_and_the_place_only_when_it_should(pattern):
    rng = random.Random(0)
    for _ in range(50):
        text = describe(ASKED, pattern, rng).lower()
        shape_at = first_index(text, SHAPE_WORDS["triangle"])
        first_index(text, COLOUR_WORDS["yellow"])
        background_at = first_index(text, COLOUR_WORDS["black"])
        names_place = "right" in text
        assert names_place == pattern.place, text
        assert not any(w in text for w in ("left", *ROW_WORDS["top"])), text
        if pattern.lead == "background":
            assert background_at < shape_at, text
        if pattern.lead == "place":
            assert text.find("right") < shape_at, text


@pytest.mark.parametrize("pattern", TRAINING_PATTERNS, ids=str)
def test_a_description_without_the_shapes_colour_is_the_same_sentence_less_the_colour_word(pattern):
    def words(text: str) -> list[str]:  # "a"/"an" go with whatever follows, so they are left out
        return [w for w in text.lower().split() if w not in ("a", "an")]

    for seed in range(30):
        coloured = describe(ASKED, pattern, random.Random(seed))
        uncoloured = describe(ASKED, pattern, random.Random(seed), shape_colour=False)
        assert words(uncoloured) == [w for w in words(coloured) if w not in COLOUR_WORDS["yellow"]], coloured
        assert len(words(uncoloured)) == len(words(coloured)) - 1


def test_no_colour_word_is_also_another_colours():
    for colour, words in COLOUR_WORDS.items():
        for other, others in COLOUR_WORDS.items():
            if other != colour:
                assert not any(o in w for w in words for o in others), (colour, other)


def test_whole_patterns_are_held_out_and_training_still_has_every_form_and_every_lead():
    assert HELD_OUT_PATTERNS and not HELD_OUT_PATTERNS & set(TRAINING_PATTERNS)
    assert set(TRAINING_PATTERNS) | HELD_OUT_PATTERNS == set(PATTERNS)
    assert {p.form for p in TRAINING_PATTERNS} == {"statement", "request", "phrase"}
    assert {p.lead for p in TRAINING_PATTERNS} == {"shape", "background", "place"}
    assert any(not p.place for p in TRAINING_PATTERNS)
    # The held-out ways of saying it are each trained in another form: a request never leads with the
    # background in training, but statements and phrases do.
    for held in HELD_OUT_PATTERNS:
        assert any(p.lead == held.lead and p.place == held.place for p in TRAINING_PATTERNS), held


def test_descriptions_vary_and_a_seed_gives_the_same_ones():
    def some(seed: int) -> list[str]:
        rng = random.Random(seed)
        return [describe(ASKED, rng.choice(TRAINING_PATTERNS), rng) for _ in range(300)]

    assert some(3) == some(3)
    assert len(set(some(3))) > 250
    lengths = [len(text.split()) for text in some(3)]
    assert min(lengths) <= 5 and max(lengths) >= 14  # terse and long


def test_a_description_reads_like_a_person_wrote_it():
    rng = random.Random(7)
    texts = [describe(ASKED, Pattern("request", "shape", True), rng) for _ in range(5)]
    assert all("  " not in t and not t.startswith(" ") and ",," not in t for t in texts), texts
    white = demo_scenes.Attributes("circle", "red", "white", "top", "left")
    said = [describe(white, Pattern("statement", "shape", True), rng).lower() for _ in range(200)]
    assert not any(" a ivory" in t or " a emerald" in t for t in said)
    assert any("an ivory" in t for t in said)
