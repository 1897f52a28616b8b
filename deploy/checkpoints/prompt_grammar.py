"""How people ask for the demo's picture: a grammar of descriptions, not a fixed list of sentences.

A description names the shape (a colour and a noun), the background colour and, or not, the quarter. Its
*pattern* is how it is put together: the form (a statement, a request, a bare phrase), which part comes first
(the shape, the background or the place) and whether a place is named at all. Within a pattern every word is
drawn: synonyms for each colour, shape and place, the verb of a request, the way the background is said,
a lead-in or a tail that makes the sentence long, the casing and the final punctuation.

Whole patterns are held out (``HELD_OUT_PATTERNS``): a model trained on the others can be asked for a picture
it has seen in a way of saying it that it never read. A description without a place leaves the quarter to
chance, so the judge does not score it (``benchmarks/prompt_following.py`` asks in these four groups).

Everything is a pure function of the attributes, the pattern and the random generator passed in.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from itertools import product
from typing import Literal, get_args

from deploy.checkpoints.demo_scenes import Attributes

Form = Literal["statement", "request", "phrase"]
Lead = Literal["shape", "background", "place"]

COLOUR_WORDS: dict[str, tuple[str, ...]] = {
    "red": ("red", "crimson", "scarlet"),
    "green": ("green", "emerald", "grass-green"),
    "blue": ("blue", "cobalt", "royal blue"),
    "yellow": ("yellow", "golden", "lemon-yellow"),
    "white": ("white", "snow-white", "ivory"),
    "black": ("black", "jet-black", "coal-black"),
}
SHAPE_WORDS: dict[str, tuple[str, ...]] = {
    "circle": ("circle", "disc", "dot", "round shape", "ball"),
    "square": ("square", "box", "block", "square shape", "tile"),
    "triangle": ("triangle", "triangular shape", "three-sided shape", "wedge"),
}
ROW_WORDS = {"top": ("top", "upper"), "bottom": ("bottom", "lower")}
PLACES = ("in the {r} {c}", "in the {r}-{c} corner", "at the {r} {c}", "in the {r} {c} quarter", "{r} {c}")
# The background after the shape ("a red circle on a blue background") and before it ("on blue, a red circle").
BACKGROUND_AFTER = ("on {a_b} background", "against {a_b} backdrop", "on {b}", "over a plain {b} background")
BACKGROUND_BEFORE = ("on {a_b} background,", "against {b},", "{b} background:", "the background is {b};")
VERBS = ("draw", "paint", "make", "please draw", "can you draw", "i'd like", "show me", "give me")
LONG_LEADS = ("i need a simple picture:", "for a test image,", "here is what i want:", "picture this:")
LONG_TAILS = ("and nothing else", "please", "keep it simple", "flat colours, no texture")
ENDINGS = ("", "", ".", "!")


@dataclass(frozen=True)
class Pattern:
    """How a description is put together; the words within it are drawn."""

    form: Form
    lead: Lead  # the part named first
    place: bool  # whether the quarter is named

    def __str__(self) -> str:
        return f"{self.form}, {self.lead} first" + ("" if self.place else ", no place")


# Every pattern: three forms x three leads with a place, and x two leads (shape, background) without one.
FORMS: tuple[Form, ...] = get_args(Form)
LEADS: tuple[Lead, ...] = get_args(Lead)
PATTERNS: tuple[Pattern, ...] = tuple(
    Pattern(form, lead, place) for form, lead, place in product(FORMS, LEADS, (True, False)) if place or lead != "place"
)
# Never trained on: a request that names the background first and a statement that starts with the place.
HELD_OUT_PATTERNS: frozenset[Pattern] = frozenset(
    {Pattern("request", "background", True), Pattern("statement", "place", True)}
)
TRAINING_PATTERNS: tuple[Pattern, ...] = tuple(p for p in PATTERNS if p not in HELD_OUT_PATTERNS)


def describe(asked: Attributes, pattern: Pattern, rng: random.Random, shape_colour: bool = True) -> str:
    """One way a person might ask for ``asked`` in ``pattern`` (its quarter unsaid when the pattern names none;
    the shape's colour unsaid when ``shape_colour`` is false: "a square on a red background")."""
    colour = rng.choice(COLOUR_WORDS[asked.colour])  # drawn either way: the same seed gives the same other words
    noun = rng.choice(SHAPE_WORDS[asked.shape])
    background = rng.choice(COLOUR_WORDS[asked.background])
    named = f"{colour} {noun}" if shape_colour else noun
    shape = named if pattern.form == "phrase" else f"{_article(named)} {named}"
    place = rng.choice(PLACES).format(r=rng.choice(ROW_WORDS[asked.row]), c=asked.column) if pattern.place else ""
    text = _put_together(pattern, shape, background, place, rng)
    if rng.random() < 0.3:  # a long request
        text = f"{rng.choice(LONG_LEADS)} {text}, {rng.choice(LONG_TAILS)}"
    return _surface(text, rng)


def _put_together(pattern: Pattern, shape: str, background: str, place: str, rng: random.Random) -> str:
    a_background = f"{_article(background)} {background}"
    after = rng.choice(BACKGROUND_AFTER).format(b=background, a_b=a_background)
    before = rng.choice(BACKGROUND_BEFORE).format(b=background, a_b=a_background)
    at = f", {place}" if place else ""
    if pattern.form == "phrase":
        parts = {"shape": shape, "background": f"{background} background", "place": place}
        order = [pattern.lead, *(p for p in ("shape", "background", "place") if p != pattern.lead)]
        return ", ".join(parts[p] for p in order if parts[p])
    verb = rng.choice(VERBS) if pattern.form == "request" else rng.choice(("there is", "i see"))
    if pattern.lead == "shape":
        if pattern.form == "request":
            return f"{verb} {shape} {after}{at}"
        return rng.choice((f"{shape} {after}{at}", f"{shape} sits {after}{at}", f"{verb} {shape} {after}{at}"))
    if pattern.lead == "background":
        return f"{before} {verb} {shape}{at}"
    return f"{place}, {verb} {shape} {after}"


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _surface(text: str, rng: random.Random) -> str:
    casing = rng.random()
    if casing < 0.5:
        text = text[0].upper() + text[1:]
    elif casing < 0.55:
        text = text.upper()
    return text + rng.choice(ENDINGS)
