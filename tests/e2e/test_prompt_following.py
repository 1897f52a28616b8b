"""The picture follows the prompt: the demo model (the DiT's default), served by the real pair and called with the
official ``openai`` client, draws the asked shape, colours and position as an independent judge reads them; the
random tiny model, through the same path, fails the same check. The prefix cache changes no picture."""

from __future__ import annotations

import base64
import io
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from openai import BadRequestError, OpenAI
from PIL import Image

from benchmarks.prompt_judge import judge
from deploy.checkpoints import demo_scenes, prompt_grammar
from dit_service.app import create_dit_app
from services.checkpoints import DIT_MODEL, default_model_dir
from services.model_card import ModelCard
from shared.diffusion import parse_size
from tests.conftest import API_KEY, PLUMBING_DIT_MODEL_DIR, Stack, dit_settings, require_checkpoint
from tests.support.dit_pools import pointed_at
from tests.support.live_server import LiveServer

pytestmark = pytest.mark.slow

DEMO_MODEL_DIR = default_model_dir(DIT_MODEL)
STEPS = 20
ATTRIBUTES = ("shape", "colour", "background", "position")
# Prompts as people write them (deploy/checkpoints/prompt_grammar.py), one seed each, about a minute of rendering
# for both models: seen colour x shape pairs in the two patterns held out of training, scored on all four
# attributes, and seen pairs with no place named, scored on the shape and both colours.
HELD_OUT_WORDINGS = 24
UNPLACED = 12
# benchmarks/results/prompt_following.json (80 renders a group through the services, 20 steps, the card's
# guidance 2 and step cache) measured the demo model on seen pairs in held-out wordings at shape 0.97, colours
# 1.00 and quarter 1.00, and with no place named at shape 0.85, shape colour 0.93, background 0.97. Each floor is
# the largest share k/n that a model right with that p (taken at most 0.95) misses less than 1% of the time:
# P[Bin(24, 0.95) < 20] = 0.6%, P[Bin(12, 0.85) < 7] = 0.5%, P[Bin(12, 0.925) < 9] = 0.96%,
# P[Bin(12, 0.95) < 9] = 0.2%. The random model scores
# 0.13-0.38 on each attribute (chance: 1/3 shape, 1/5 colour, 1/4 quarter) and reaches 20/24 on any of them with a
# chance below 1e-4.
FLOORS = {"shape": 20 / 24, "colour": 20 / 24, "background": 20 / 24, "position": 20 / 24}
UNPLACED_FLOORS = {"shape": 7 / 12, "colour": 9 / 12, "background": 9 / 12}
# Long enough to fill a KV-cache block (128 tokens on CPU), so the second request is served from the cache.
CACHED_PROMPT = "a red circle on a blue background, in the top left. " * 14


def prompts(patterns: list[prompt_grammar.Pattern], count: int, seed: int) -> list[tuple[str, demo_scenes.Attributes]]:
    rng = random.Random(seed)
    chosen = rng.sample(demo_scenes.seen_attributes(), count)
    return [(prompt_grammar.describe(a, rng.choice(patterns), rng), a) for a in chosen]


HELD_OUT_PROMPTS = prompts(sorted(prompt_grammar.HELD_OUT_PATTERNS, key=str), HELD_OUT_WORDINGS, seed=13)
UNPLACED_PROMPTS = prompts([p for p in prompt_grammar.TRAINING_PATTERNS if not p.place], UNPLACED, seed=14)


@contextmanager
def serving(stack: Stack, model_dir: Path) -> Iterator[OpenAI]:
    """The running AR in front of a DiT that serves ``model_dir``, for the length of the block."""
    dit = LiveServer(create_dit_app(dit_settings(model_dir=require_checkpoint(model_dir)))).start().wait_ready()
    try:
        with pointed_at(stack, dit.url):
            yield OpenAI(base_url=stack.api_base, api_key=API_KEY, max_retries=0, timeout=120)
    finally:
        dit.stop()


@pytest.fixture(scope="module")
def demo(stack) -> Iterator[OpenAI]:
    with serving(stack, DEMO_MODEL_DIR) as client:
        yield client


def picture(result) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json)))


def accuracy(client: OpenAI, cases: list[tuple[str, demo_scenes.Attributes]]) -> dict[str, float]:
    """Render every prompt (seed = its index) and judge it: the share right, per attribute."""
    hits = dict.fromkeys(ATTRIBUTES, 0)
    for seed, (prompt, asked) in enumerate(cases):
        result = client.images.generate(
            model="ardit", prompt=prompt, size="64x64", extra_body={"seed": seed, "num_inference_steps": STEPS}
        )
        reading = judge(picture(result))
        hits["shape"] += reading.shape == asked.shape
        hits["colour"] += reading.colour == asked.colour
        hits["background"] += reading.background == asked.background
        hits["position"] += (reading.row, reading.column) == (asked.row, asked.column)
    return {name: count / len(cases) for name, count in hits.items()}


def follows_prompts(client: OpenAI) -> tuple[bool, dict[str, dict[str, float]]]:
    """Whether every attribute of both groups reaches its floor, and the scores."""
    scores = {"held_out_wordings": accuracy(client, HELD_OUT_PROMPTS), "no_place": accuracy(client, UNPLACED_PROMPTS)}
    followed = all(scores["held_out_wordings"][a] >= floor for a, floor in FLOORS.items()) and all(
        scores["no_place"][a] >= floor for a, floor in UNPLACED_FLOORS.items()
    )
    return followed, scores


def test_models_endpoint_describes_the_demo_model_by_its_card(demo):
    described = demo.models.retrieve("ardit").model_extra["description"]
    assert described == ModelCard.read(DEMO_MODEL_DIR).description
    assert "trained from scratch" in described and "procedurally drawn scenes" in described


def test_the_demo_model_draws_only_the_sizes_its_card_lists_and_auto_is_the_first(demo):
    sizes = ModelCard.read(DEMO_MODEL_DIR).sizes
    assert sizes, "the demo card lists the sizes the judge found it draws"
    assert demo.models.retrieve("ardit").model_extra["sizes"] == sizes
    # What OpenAI clients and chat UIs send unless told otherwise, and the next size up from the card's (one
    # size multiple past it): a 400 that names the sizes, nothing drawn.
    for unlisted in ("1024x1024", "80x80"):
        with pytest.raises(BadRequestError) as refused:
            demo.images.generate(model="ardit", prompt="a red circle on a blue background", size=unlisted)
        error = refused.value.body
        assert isinstance(error, dict) and (error["param"], error["code"]) == ("size", "invalid_size")
        assert all(f"'{size}'" in error["message"] for size in [*sizes, "auto"]), error
    auto = demo.images.generate(model="ardit", prompt="a red circle on a blue background", extra_body={"seed": 1})
    assert auto.size == sizes[0] and picture(auto).size == parse_size(sizes[0])


def test_demo_model_draws_what_people_ask_in_wordings_it_never_read_and_with_no_place_named(demo):
    followed, scores = follows_prompts(demo)
    assert followed, scores


def test_random_model_fails_the_same_check(stack):
    with serving(stack, PLUMBING_DIT_MODEL_DIR) as client:
        followed, scores = follows_prompts(client)
    assert not followed, scores


# What a hit may change in the demo's picture in bf16 (this machine's default): its tail rows are computed in a batch
# of another shape, and the CPU's bf16 kernels may round them one step apart; the demo DiT turns that into up to
# 21/255, 0.54/255 on average (benchmarks/results/bf16_hit_miss.md). A wrong cache (other rows, another prompt's)
# draws another picture. In fp32 a hit is bitwise a miss (tests/e2e/test_qwen_image_reference.py).
BF16_HIT_MAX, BF16_HIT_MEAN = 32, 1.0


def test_a_prompt_served_from_the_prefix_cache_gives_the_same_picture(demo):
    request = {"seed": 4, "num_inference_steps": STEPS, "cache_salt": "e2e-demo-prefix-cache"}
    cold = demo.images.generate(model="ardit", prompt=CACHED_PROMPT, size="64x64", extra_body=request)
    warm = demo.images.generate(model="ardit", prompt=CACHED_PROMPT, size="64x64", extra_body=request)
    assert cold.usage.model_extra["cached_tokens"] == 0
    assert warm.usage.model_extra["cached_tokens"] > 0
    difference = abs(
        np.asarray(picture(warm).convert("RGB"), dtype=np.int16)
        - np.asarray(picture(cold).convert("RGB"), dtype=np.int16)
    )
    assert difference.max() <= BF16_HIT_MAX and difference.mean() <= BF16_HIT_MEAN, (
        difference.max(),
        difference.mean(),
    )
    assert judge(picture(warm)) == judge(picture(cold))  # the same scene
