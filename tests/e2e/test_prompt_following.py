"""The picture follows the prompt: the demo model, served by the real pair and called with the official
``openai`` client, draws the asked shape, colours and position, as an independent judge reads them; the
random tiny model, through the same path, does not come near the floor."""

from __future__ import annotations

import base64
import io
import random
from pathlib import Path

import pytest
from openai import OpenAI
from PIL import Image

from ar_service.handoff_client import HandoffClient
from benchmarks.prompt_judge import judge
from deploy.checkpoints import demo_scenes
from dit_service.app import create_dit_app
from dit_service.settings import default_model_dir as default_dit_model_dir
from tests.conftest import API_KEY, HANDOFF_TOKEN, Stack, dit_settings, require_checkpoint
from tests.support.live_server import LiveServer

pytestmark = pytest.mark.slow

DEMO_MODEL_DIR = Path(__file__).resolve().parents[2] / "deploy" / "checkpoints" / "ardit-demo"
PROMPTS = 24  # trained combinations, one seed each: ~10 s of rendering on 2 cores
STEPS = 20
ATTRIBUTES = ("shape", "colour", "background", "position")
# Per attribute, over the 24 renders. benchmarks/results/prompt_following.json measured the demo model at
# >= 0.95 on every attribute of trained combinations (240 renders, 20 steps); 0.75 leaves room for a
# small sample (P[<= 18 of 24 right] < 1% at p = 0.95) and still sits far above what noise scores.
FLOOR = 0.75


def prompts() -> list[tuple[str, demo_scenes.Attributes]]:
    rng = random.Random(13)
    return [(rng.choice(demo_scenes.wordings(a)), a) for a in rng.sample(demo_scenes.seen_attributes(), PROMPTS)]


def accuracy(stack: Stack, model_dir: Path) -> dict[str, float]:
    """Serve ``model_dir`` behind the running AR, render every prompt and judge it."""
    dit = LiveServer(create_dit_app(dit_settings(model_dir=require_checkpoint(model_dir)))).start().wait_ready()
    generator = stack.runtime.generator
    served = generator.dit
    generator.dit = HandoffClient(dit.url, HANDOFF_TOKEN, 5.0, 120.0)
    client = OpenAI(base_url=stack.api_base, api_key=API_KEY, max_retries=0, timeout=120)
    hits = dict.fromkeys(ATTRIBUTES, 0)
    try:
        for seed, (prompt, asked) in enumerate(prompts()):
            result = client.images.generate(
                model="ardit", prompt=prompt, size="64x64", extra_body={"seed": seed, "num_inference_steps": STEPS}
            )
            reading = judge(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))))
            hits["shape"] += reading.shape == asked.shape
            hits["colour"] += reading.colour == asked.colour
            hits["background"] += reading.background == asked.background
            hits["position"] += (reading.row, reading.column) == (asked.row, asked.column)
    finally:
        stack.ar.call(generator.dit.aclose())
        generator.dit = served
        dit.stop()
    return {name: count / PROMPTS for name, count in hits.items()}


def test_demo_model_draws_the_asked_shape_colours_and_position(stack):
    scores = accuracy(stack, DEMO_MODEL_DIR)
    assert all(value >= FLOOR for value in scores.values()), scores


def test_random_model_stays_below_the_floor(stack):
    scores = accuracy(stack, default_dit_model_dir())
    assert all(value < FLOOR for value in scores.values()), scores
