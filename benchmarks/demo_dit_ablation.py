"""What to spend the demo model's training budget on: whole training runs that differ in one thing, judged alike.

Each argument is a folder ``deploy/checkpoints/train_demo_dit.py`` wrote (its recipe in ``training_record.json``).
Each is judged on the prompt-following benchmark's four grammar groups (``benchmarks/prompt_following.py``'s
prompts and judge), offline: the pipeline the DiT service runs, the rows the AR streams (``PromptRows``, checked
against the engine by tests/deploy/test_demo_rows.py), guidance 2 against the null prompt, 20 steps, no step
cache. A group is rendered as one batch, which gives each picture what it gets alone (to 1e-5). Only whole runs
are compared: runs of 1,200 DiT steps were tried first and rank nothing, every variant still at chance on shape,
colour and quarter there. The served model's own figures come from the services (``prompt_following.py``).

Each run also gets a row-swap probe of the held-out pairs: which of the rows the AR streams decides the shape the
DiT draws. One sentence ("a blue square on a white background, in the top left", two backgrounds x four quarters)
is rendered as asked, then with the rows of the same sentence for a seen pair of the same shape ("a red square
...") except the colour word's row, which is the held-out colour's, then the other way round. The sentences
differ only in that word and the AR's model is causal, so the rows before it are the same.

    python -m benchmarks.demo_dit_ablation DIR [DIR ...] [--prompts 40] [--seeds 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from itertools import product
from pathlib import Path

import torch
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

from ar_service.settings import ArSettings
from benchmarks.prompt_following import GRAMMAR_GROUPS, accuracy, correct, correct_without_place, grammar_prompts
from benchmarks.prompt_judge import judge
from deploy.checkpoints import demo_scenes
from deploy.checkpoints import train_demo_dit as recipe
from deploy.checkpoints.build_tiny_qwen_image import SCHEDULER_CONFIG
from deploy.checkpoints.demo_rows import PromptRows
from shared.row_recipe import QWEN_IMAGE_TEMPLATE

RESULTS = Path(__file__).parent / "results"
GUIDANCE = 2.0
STEPS = 20
PROBE_SEEDS = 3


PROBE_SENTENCE = "a {colour} {shape} on a {background} background, in the {row} {column}"
PROBE_PARTNER = "red"  # every shape is seen in red
PROBE_BACKGROUNDS = ("white", "black")


def load_pipeline(model_dir: Path) -> QwenImagePipeline:
    pipeline = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=AutoencoderKLQwenImage.from_pretrained(str(model_dir / "vae")).eval(),
        text_encoder=None,  # type: ignore[arg-type]
        tokenizer=None,  # type: ignore[arg-type]
        transformer=QwenImageTransformer2DModel.from_pretrained(str(model_dir / "transformer")).eval(),
    )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@torch.no_grad()
def render(pipeline: QwenImagePipeline, rows: list[torch.Tensor], null_rows: torch.Tensor, seed: int) -> list:
    """One picture per conditioning, as one batch, against the null prompt."""
    table = recipe.RowTable(rows, null_rows)
    embeds, mask = table.batch(torch.arange(len(rows)))
    null, null_mask = table.batch(torch.full((len(rows),), table.null))
    return pipeline(
        prompt_embeds=embeds,
        prompt_embeds_mask=mask,
        negative_prompt_embeds=null,
        negative_prompt_embeds_mask=null_mask,
        true_cfg_scale=GUIDANCE,
        max_sequence_length=max(embeds.shape[1], null.shape[1]),
        height=demo_scenes.SIZE,
        width=demo_scenes.SIZE,
        num_inference_steps=STEPS,
        generator=[torch.Generator("cpu").manual_seed(seed) for _ in rows],
    ).images


def judge_groups(
    pipeline: QwenImagePipeline, encoder: PromptRows, null_rows: torch.Tensor, prompts: int, seeds: int
) -> dict:
    result = {}
    for group in GRAMMAR_GROUPS:
        cases = grammar_prompts(group, prompts)
        rows = encoder.rows([text for text, _ in cases])
        score = correct_without_place if group == "no_place" else correct
        hits = []
        for seed in range(seeds):
            pictures = render(pipeline, rows, null_rows, seed)
            hits += [score(judge(p), asked) for p, (_, asked) in zip(pictures, cases, strict=True)]
        result[group] = accuracy(hits)
    return result


def probe_colour_row(pipeline: QwenImagePipeline, encoder: PromptRows, null_rows: torch.Tensor, seeds: int) -> dict:
    """Per held-out pair, the share of pictures with the asked shape: as asked; with only the colour word's row
    the held-out colour's (the rest the seen partner's); with every row but that one the held-out sentence's."""
    cases: list[tuple[str, str, torch.Tensor]] = []  # (pair, variant, rows)
    for (colour, shape), background, row, column in product(
        sorted(demo_scenes.HELD_OUT_PAIRS), PROBE_BACKGROUNDS, demo_scenes.ROWS, demo_scenes.COLUMNS
    ):
        held, seen = encoder.rows(
            [
                PROBE_SENTENCE.format(colour=c, shape=shape, background=background, row=row, column=column)
                for c in (colour, PROBE_PARTNER)
            ]
        )
        word = next(i for i in range(len(held)) if not torch.equal(held[i], seen[i]))  # the colour word's row
        pair = f"{colour} {shape}"
        cases += [
            (pair, "as_asked", held),
            (pair, "colour_row_only", torch.cat([seen[:word], held[word : word + 1], seen[word + 1 :]])),
            (pair, "all_but_the_colour_row", torch.cat([held[:word], seen[word : word + 1], held[word + 1 :]])),
        ]
    hits: dict[str, dict[str, list[bool]]] = {}
    for seed in range(seeds):
        pictures = render(pipeline, [rows for _, _, rows in cases], null_rows, seed)
        for picture, (pair, variant, _) in zip(pictures, cases, strict=True):
            hits.setdefault(pair, {}).setdefault(variant, []).append(judge(picture).shape == pair.split()[1])
    return {pair: {v: sum(h) / len(h) for v, h in variants.items()} for pair, variants in hits.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", type=Path, help="folders train_demo_dit.py wrote")
    ap.add_argument("--prompts", type=int, default=40, help="prompts in each of the four groups")
    ap.add_argument("--seeds", type=int, default=2, help="seeds per prompt")
    ap.add_argument("--out", type=Path, default=RESULTS / "demo_dit_ablation.json")
    args = ap.parse_args()
    torch.set_num_threads(recipe.TORCH_THREADS)
    report: dict = {
        "command": "python -m benchmarks.demo_dit_ablation " + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "prompts_per_group": args.prompts,
        "seeds": args.seeds,
        "guidance_scale": GUIDANCE,
        "num_inference_steps": STEPS,
        "probe": {
            "sentence": PROBE_SENTENCE,
            "partner_colour": PROBE_PARTNER,
            "backgrounds": PROBE_BACKGROUNDS,
            "seeds": PROBE_SEEDS,
        },
        "runs": {},
    }
    for model_dir in args.models:
        record = json.loads((model_dir / "training_record.json").read_text())
        # Each run is judged on the rows it was trained on: the AR layer its record names.
        encoder = PromptRows(ArSettings().model_dir, QWEN_IMAGE_TEMPLATE, record.get("hidden_layer"))
        null_rows = encoder.rows([recipe.NULL_PROMPT])[0]
        pipeline = load_pipeline(model_dir)
        scores = judge_groups(pipeline, encoder, null_rows, args.prompts, args.seeds)
        probe = probe_colour_row(pipeline, encoder, null_rows, PROBE_SEEDS)
        report["runs"][str(model_dir)] = {
            "training": {k: record.get(k) for k in ("command", "hidden_layer", "seconds", "data", "dit")},
            "accuracy": scores,
            "held_out_pair_shape_by_rows": probe,
        }
        print(model_dir, json.dumps(scores), json.dumps(probe), flush=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
