"""Does the demo model draw what the prompt asks? Rendered through the running services, scored by a judge.

First the judge (``prompt_judge.py``, no code shared with the model) reads the scene generator's own clean
pictures: every combination, twice; its accuracy there bounds what it can say about the model. Then a fixed,
seeded set of prompts (new wordings drawn from the generator's templates) goes through the public API with
the official ``openai`` client, each with several seeds, and the judge reads every picture. Accuracy per
attribute (shape, shape colour, background colour, position, and all four at once) is reported for the
combinations the model was trained on and the held-out colour x shape pairs apart. Then prompts written the way
people write them (``deploy/checkpoints/prompt_grammar.py``), in four groups reported apart: seen pairs in the
grammar's training patterns, seen pairs in its held-out patterns, held-out pairs, and no place named (its quarter
then not scored). With ``--vae-of`` the judge
also reads fresh pictures round-tripped through the model's VAE: every picture the DiT makes is a decoded
latent, so that is the most the DiT could score.

Start the services with the demo model first (``make run``, or ``python -m services.launcher`` with
``ARDIT_DIT_MODEL_DIR=deploy/checkpoints/ardit-demo``), then::

    python -m benchmarks.prompt_following [--base-url http://127.0.0.1:8000/v1] [--steps 20] [--seeds 2] \\
        [--size auto] [--vae-of deploy/checkpoints/ardit-demo]

``--size`` asks for another size than the card's: with ``ARDIT_DIT_SIZES='[]'`` on the DiT (any size) that is
how the card's list of sizes was decided (benchmarks/results/prompt_following_sizes/).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

# From its own module: to a type checker diffusers' top-level AutoencoderKLQwenImage is a no-torch placeholder.
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from openai import OpenAI
from PIL import Image

from benchmarks.prompt_judge import Reading, judge
from deploy.checkpoints import demo_scenes, prompt_grammar

RESULTS = Path(__file__).parent / "results"
ATTRIBUTES = ("shape", "colour", "background", "position")
PROMPT_SEED = 2026


def correct(reading: Reading, asked: demo_scenes.Attributes) -> dict[str, bool]:
    hits = {
        "shape": reading.shape == asked.shape,
        "colour": reading.colour == asked.colour,
        "background": reading.background == asked.background,
        "position": (reading.row, reading.column) == (asked.row, asked.column),
    }
    return {**hits, "all": all(hits.values())}


def accuracy(results: list[dict[str, bool]]) -> dict[str, float]:
    return {key: round(sum(r[key] for r in results) / len(results), 4) for key in results[0]}


def correct_without_place(reading: Reading, asked: demo_scenes.Attributes) -> dict[str, bool]:
    """For a prompt that names no quarter: any quarter is right, so it is not scored."""
    hits = {key: hit for key, hit in correct(reading, asked).items() if key not in ("position", "all")}
    return {**hits, "all": all(hits.values())}


def judge_on_clean_pictures() -> dict:
    rng = random.Random(PROMPT_SEED)
    scores = [
        correct(judge(demo_scenes.draw(demo_scenes.random_scene(a, rng))), a)
        for a in demo_scenes.all_attributes()
        for _ in range(2)
    ]
    return {"pictures": len(scores), "accuracy": accuracy(scores)}


def judge_on_vae_round_trips(model_dir: Path, count: int = 400) -> dict:
    """Fresh pictures of trained combinations through the model's own VAE (encode, decode): what the judge reads
    there is the most the DiT could reach, since every picture it makes is a decoded latent."""
    vae = AutoencoderKLQwenImage.from_pretrained(str(model_dir / "vae")).eval()
    rng = random.Random(PROMPT_SEED + 1)
    asked = [rng.choice(demo_scenes.seen_attributes()) for _ in range(count)]
    pictures = [demo_scenes.draw(demo_scenes.random_scene(a, rng)) for a in asked]
    pixels = torch.stack([torch.from_numpy(np.array(p)).permute(2, 0, 1) for p in pictures]).float() / 127.5 - 1
    with torch.no_grad():
        decoded = vae.decode(vae.encode(pixels[:, :, None]).latent_dist.mode()).sample[:, :, 0]
    rgb = ((decoded.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    scores = [correct(judge(Image.fromarray(picture)), a) for picture, a in zip(rgb, asked, strict=True)]
    return {"pictures": len(scores), "accuracy": accuracy(scores)}


# The grammar's groups (deploy/checkpoints/prompt_grammar.py): which colour x shape pairs, said in which patterns.
_PLACED = [p for p in prompt_grammar.TRAINING_PATTERNS if p.place]
GRAMMAR_GROUPS: dict[str, tuple[str, list[prompt_grammar.Pattern]]] = {
    "trained_wordings": ("seen", _PLACED),
    "held_out_wordings": ("seen", [p for p in prompt_grammar.PATTERNS if p in prompt_grammar.HELD_OUT_PATTERNS]),
    "held_out_pairs": ("held_out", _PLACED),
    "no_place": ("seen", [p for p in prompt_grammar.TRAINING_PATTERNS if not p.place]),
}


def grammar_prompts(group: str, count: int) -> list[tuple[str, demo_scenes.Attributes]]:
    pairs, patterns = GRAMMAR_GROUPS[group]
    rng = random.Random(f"{PROMPT_SEED}-{group}")
    pool = demo_scenes.seen_attributes() if pairs == "seen" else demo_scenes.held_out_attributes()
    return [(prompt_grammar.describe(a, rng.choice(patterns), rng), a) for a in rng.sample(pool, count)]


def benchmark_prompts(seen: int, held_out: int) -> list[tuple[str, demo_scenes.Attributes]]:
    """The generator's own templates (what the demo model was trained on)."""
    rng = random.Random(PROMPT_SEED)
    chosen = rng.sample(demo_scenes.seen_attributes(), seen) + rng.sample(demo_scenes.held_out_attributes(), held_out)
    return [(rng.choice(demo_scenes.wordings(a)), a) for a in chosen]


def render(client: OpenAI, prompt: str, seed: int, steps: int, guidance_scale: float | None, size: str) -> Image.Image:
    extra: dict[str, float] = {"seed": seed, "num_inference_steps": steps}
    if guidance_scale is not None:
        extra["guidance_scale"] = guidance_scale
    result = client.images.generate(model="ardit", prompt=prompt, size=size, extra_body=extra)
    assert result.data and result.data[0].b64_json is not None
    return Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).convert("RGB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"))
    ap.add_argument("--steps", type=int, default=20, help="num_inference_steps")
    ap.add_argument("--guidance-scale", type=float, default=None, help="default: the service's")
    ap.add_argument("--seeds", type=int, default=2, help="seeds per prompt")
    ap.add_argument("--size", default="auto", help="WIDTHxHEIGHT, or auto: the model card's size")
    ap.add_argument("--seen", type=int, default=80, help="prompts of trained combinations")
    ap.add_argument("--held-out", type=int, default=40, help="prompts of held-out colour x shape pairs")
    ap.add_argument("--grammar", type=int, default=40, help="prompts in each of the grammar's four groups")
    ap.add_argument(
        "--vae-of",
        type=Path,
        default=None,
        help="the served model's folder: also judge pictures round-tripped through its VAE (the DiT's ceiling)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "prompt_following.json")
    args = ap.parse_args()

    load_at_start = os.getloadavg()
    clean = judge_on_clean_pictures()
    print(f"judge on {clean['pictures']} clean pictures: {clean['accuracy']}", flush=True)
    round_trips = judge_on_vae_round_trips(args.vae_of) if args.vae_of else None
    if round_trips:
        print(f"judge on {round_trips['pictures']} VAE round trips: {round_trips['accuracy']}", flush=True)

    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=120)
    model = client.models.retrieve("ardit").model_dump()
    cases = [
        ("held_out" if a.held_out else "seen", prompt, a) for prompt, a in benchmark_prompts(args.seen, args.held_out)
    ]
    if args.grammar:
        cases += [(group, prompt, a) for group in GRAMMAR_GROUPS for prompt, a in grammar_prompts(group, args.grammar)]
    scores: dict[str, list[dict[str, bool]]] = {group: [] for group, _, _ in cases}
    failures = []
    drawn: set[str] = set()
    started = time.perf_counter()
    for group, prompt, asked in cases:
        for seed in range(args.seeds):
            picture = render(client, prompt, seed, args.steps, args.guidance_scale, args.size)
            drawn.add(f"{picture.width}x{picture.height}")
            reading = judge(picture)
            hits = correct_without_place(reading, asked) if group == "no_place" else correct(reading, asked)
            scores[group].append(hits)
            if not hits["all"]:
                failures.append({"group": group, "prompt": prompt, "seed": seed, "read": reading.__dict__})
    seconds = time.perf_counter() - started

    report = {
        "command": "python -m benchmarks.prompt_following " + " ".join(sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average_at_start": load_at_start,
            "load_average_at_end": os.getloadavg(),
        },
        "model": model,
        "num_inference_steps": args.steps,
        "guidance_scale": args.guidance_scale,
        "size": args.size,
        "drawn_at": sorted(drawn),
        "judge_on_clean_pictures": clean,
        "judge_on_vae_round_trips": round_trips,
        "renders": {split: len(s) for split, s in scores.items()},
        "render_seconds": round(seconds, 1),
        "accuracy": {split: accuracy(s) for split, s in scores.items() if s},
        "failures": failures,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["accuracy"], indent=2))
    print(f"{sum(report['renders'].values())} renders in {seconds:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
