"""Decoy captions: a caption's rows with the shape colour word's rows taken from a sentence that says another colour.

The AR's model is causal, so in "a red square on a blue background, ..." the rows up to "red" are those of the
text "a red", and every later row has read "red". A decoy keeps those later rows and puts in front of them the
rows of the same opening with another colour word ("a green"), while the picture stays a red square. Trained
on some decoys, the DiT cannot take the shape's colour, nor its form, from the colour word's row alone: it
must read them from the rows after it, which say both.

Why: a row-swap probe (``benchmarks/demo_dit_ablation.py``) found the DiT reading a held-out pair's shape from
the colour word's row: every blue picture it saw is a circle or a triangle, so the row of "blue" came to say
"not a square" whatever noun followed. In a decoy the row of "blue" stands before squares too.

Measured (``train_demo_dit``'s docstring, ``benchmarks/results/demo_dit_ablation.json``): with a quarter of the
captions decoys, the colour word's row no longer decides the shape, but the rows after it do, since each of them
has read the colour too; the held-out pairs' shape did not improve (0.45 -> 0.41). The recipe leaves it off.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deploy.checkpoints.demo_rows import PromptRows
from deploy.checkpoints.prompt_grammar import COLOUR_WORDS


@dataclass(frozen=True)
class Decoy:
    """``text``'s colour word ends after ``kept_from`` of its rows; ``opening`` is what replaces those rows."""

    text: int
    opening: str
    kept_from: int


def colour_word_span(text: str, colour: str) -> tuple[int, int] | None:
    """Where ``text`` names ``colour`` (any of its words, the longest first), or None if it does not."""
    for word in sorted(COLOUR_WORDS[colour], key=len, reverse=True):
        found = re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text, flags=re.IGNORECASE)
        if found:
            return found.span()
    return None


def starts_with_a_vowel(word: str) -> bool:
    return word[0].lower() in "aeiou"


def in_the_same_case(word: str, like: str) -> str:
    if like.isupper():
        return word.upper()
    return word[0].upper() + word[1:] if like[0].isupper() else word


def plan(
    encoder: PromptRows, texts: Sequence[str], colours: Sequence[tuple[str, str] | None], rng: random.Random
) -> list[Decoy]:
    """One decoy per text that names its shape's colour. ``colours[i]``: the shape's and the background's colour
    of ``texts[i]``, None for a text without them. The decoy's colour is neither of the two."""
    tail = len(encoder.builder.build("").token_ids) - encoder.builder.prefix_tokens
    decoys = []
    for i, (text, asked) in enumerate(zip(texts, colours, strict=True)):
        if asked is None:
            continue
        shape_colour, background = asked
        span = colour_word_span(text, shape_colour)
        if span is None:
            continue
        start, end = span
        ids = encoder.builder.build(text).token_ids
        opening_ids = encoder.builder.build(text[:end]).token_ids
        kept_from = len(opening_ids) - tail
        # A decoy needs the colour word to end at a token boundary of the whole text; every word here does, but
        # a text where it does not simply gets no decoy.
        if ids[:kept_from] != opening_ids[:kept_from]:
            continue
        said = text[start:end]
        # Words that take the same article ("a crimson", "an ivory"), so that the words before stay right.
        words = [
            word
            for other in sorted(set(COLOUR_WORDS) - {shape_colour, background})
            for word in COLOUR_WORDS[other]
            if starts_with_a_vowel(word) == starts_with_a_vowel(said)
        ]
        if not words:
            continue
        word = in_the_same_case(rng.choice(words), said)
        decoys.append(Decoy(i, text[:start] + word, kept_from - encoder.builder.prefix_tokens))
    return decoys


def rows(encoder: PromptRows, decoys: Sequence[Decoy], text_rows: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each decoy's rows: its opening's rows (without the template's tail), then the text's after its colour word."""
    openings = sorted({d.opening for d in decoys})
    tail = len(encoder.builder.build("").token_ids) - encoder.builder.prefix_tokens
    opening_rows = dict(zip(openings, encoder.rows(openings), strict=True))
    return [torch.cat([opening_rows[d.opening][:-tail], text_rows[d.text][d.kept_from :]]) for d in decoys]
