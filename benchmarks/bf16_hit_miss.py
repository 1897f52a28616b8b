"""Prefix-cache hit against miss in bf16: how far a render from a cache hit is from a cold one.

A hit reuses the stored rows of the prompt's whole cached blocks and computes the rest attending to the cached
keys and values; a miss computes all of it in one prefill. In fp32 the two are bitwise equal (the reference
tests check it); in bf16 the tail is computed in batches of another shape, so its rounding may differ. This
measures by how much, over prompts whose templated length falls around the CPU's 128-token blocks (under a
block, one short of, at and one past a boundary, a partial tail, a long prefix) and several seeds:

- the reused prefix rows, which must be bitwise the miss's, and a second miss (another salt), which shows
  whether a difference is the cache's or the engine's own from run to run;
- the conditioning rows (the template's 34 dropped): max and mean absolute difference, least row cosine;
- the pictures (64x64 at the model's card defaults, CFG against its negative prompt, same seed): max and mean
  absolute pixel difference, and the share of pixel values that differ.

Each model runs its engine in this process (the AR's ``HiddenStateEngine``, as the service does) and renders with
diffusers' ``QwenImagePipeline`` on the rows, which is what the DiT's renderer calls (bitwise, tests/dit_service):

- ``qwen-image``: the tiny full Qwen-Image (``make checkpoints``), text encoder and DiT from its folder;
- ``demo``: SmolLM2 at the demo DiT's layer, and the demo DiT (``make run``'s model).

    python benchmarks/bf16_hit_miss.py [--seeds 4] [--models qwen-image,demo]

Writes ``benchmarks/results/bf16_hit_miss.json``; the page is ``benchmarks/results/bf16_hit_miss.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paired
import torch

paired.use_this_checkout()

from ar_service import ArSettings, EngineRequest, FinishedEvent, HiddenStateEngine, PromptBuilder, RowsEvent  # noqa: E402
from dit_service.settings import DitSettings  # noqa: E402
from services.checkpoints import FULL_QWEN_IMAGE_MODEL, default_model_dir  # noqa: E402
from services.model_card import ModelCard  # noqa: E402

# Templated prompt lengths in tokens, around the CPU's 128-token blocks.
LENGTHS = {
    "under a block": 60,
    "one short of a block": 127,
    "a block exactly": 128,
    "one past a block": 129,
    "a partial tail": 200,
    "two blocks and a tail": 300,
    "a long prefix": 600,
}
TEXT = (
    "A quiet harbour town at dawn, fishing boats with faded blue and red hulls tied along a stone quay, gulls "
    "circling over nets spread out to dry, a baker opening the shutters of a shop with a striped awning, "
    "cobbled streets climbing a hill toward a white chapel, laundry strung between balconies, a cat asleep on "
    "a windowsill full of geraniums, mist lifting off the water, the first light catching the tops of the "
    "masts, a lighthouse on the headland, and a small ferry leaving a trail of foam as it heads out to sea. "
)
SIZE = 64


@dataclass(frozen=True)
class Model:
    ar: Path
    dit: Path


def models() -> dict[str, Model]:
    full = default_model_dir(FULL_QWEN_IMAGE_MODEL)
    return {"qwen-image": Model(full, full), "demo": Model(ArSettings().model_dir, DitSettings().model_dir)}


def prompt_of_length(builder: PromptBuilder, length: int) -> str:
    """A prompt whose templated token count is exactly ``length``: words of TEXT while they fit, then " and"s
    (one token each) to the count."""
    words = (TEXT * 8).split(" ")
    count = max(c for c in range(1, len(words)) if len(builder.build(" ".join(words[:c])).token_ids) <= length)
    text = " ".join(words[:count])
    while len(builder.build(text).token_ids) < length:
        text += " and"
    if len(builder.build(text).token_ids) != length:
        raise ValueError(f"no prompt of exactly {length} templated tokens")
    return text


async def rows_of(engine: HiddenStateEngine, token_ids: list[int], salt: str) -> tuple[torch.Tensor, int]:
    rows: list[torch.Tensor] = []
    cached = -1
    async for event in engine.run(EngineRequest(uuid.uuid4().hex, token_ids, cache_salt=salt)):
        if isinstance(event, RowsEvent):
            rows.append(event.rows)
        elif isinstance(event, FinishedEvent):
            cached = event.cached_tokens
    return torch.cat(rows)[: len(token_ids)], cached


def render(pipeline, rows: torch.Tensor, negative: torch.Tensor, card: ModelCard, seed: int) -> np.ndarray:
    guidance = card.default_guidance_scale or 1.0
    cfg = (
        {"negative_prompt_embeds": negative[None], "true_cfg_scale": guidance, "negative_prompt_embeds_mask": None}
        if guidance > 1
        else {}
    )
    image = pipeline(
        prompt_embeds=rows[None],
        prompt_embeds_mask=None,
        height=SIZE,
        width=SIZE,
        num_inference_steps=card.default_num_inference_steps or 20,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
        **cfg,
    ).images[0]
    return (image * 255).round().astype("uint8")


def measure(name: str, model: Model, seeds: int) -> dict:
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

    settings = ArSettings(model_dir=model.ar, dtype="bfloat16", max_prompt_tokens=1024)
    engine = HiddenStateEngine(settings)
    builder = PromptBuilder.of_text_model(engine.text_model, engine.rows)
    card = ModelCard.read(model.dit)
    pipeline = QwenImagePipeline.from_pretrained(
        str(model.dit), text_encoder=None, tokenizer=None, dtype=torch.bfloat16
    )
    pipeline.set_progress_bar_config(disable=True)
    engine.start()
    loop = asyncio.new_event_loop()
    try:
        negative_ids = builder.build(card.default_negative_prompt or " ").token_ids
        negative, _ = loop.run_until_complete(rows_of(engine, negative_ids, "negative"))
        negative = negative[builder.prefix_tokens :]
        block = engine.block_size
        cases = []
        for label, length in LENGTHS.items():
            prompt = builder.build(prompt_of_length(builder, length))
            salt = f"{name}-{length}-{uuid.uuid4().hex}"
            miss, miss_cached = loop.run_until_complete(rows_of(engine, prompt.token_ids, salt))
            hit, hit_cached = loop.run_until_complete(rows_of(engine, prompt.token_ids, salt))
            cold, _ = loop.run_until_complete(rows_of(engine, prompt.token_ids, salt + "-again"))
            assert miss_cached == 0 and hit_cached == (length - 1) // block * block, (label, miss_cached, hit_cached)
            drop = prompt.prefix_tokens
            a, b = miss[drop:].float(), hit[drop:].float()
            images = [
                (render(pipeline, miss[drop:], negative, card, s), render(pipeline, hit[drop:], negative, card, s))
                for s in range(seeds)
            ]
            pixel = [np.abs(x.astype(int) - y.astype(int)) for x, y in images]
            cases.append(
                {
                    "case": label,
                    "templated_tokens": length,
                    "cached_tokens": hit_cached,
                    "reused_rows_bitwise_equal": bool(torch.equal(miss[:hit_cached], hit[:hit_cached])),
                    "rows_bitwise_equal": bool(torch.equal(miss, hit)),
                    "two_misses_bitwise_equal": bool(torch.equal(miss, cold)),
                    "conditioning_max_abs": (a - b).abs().max().item(),
                    "conditioning_mean_abs": (a - b).abs().mean().item(),
                    "conditioning_value_max": a.abs().max().item(),
                    "conditioning_min_row_cosine": torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item(),
                    "pixels_max_abs": [int(p.max()) for p in pixel],
                    "pixels_mean_abs": [float(p.mean()) for p in pixel],
                    "pixels_differing_share": [float((p > 0).mean()) for p in pixel],
                }
            )
        return {
            "ar": str(model.ar),
            "dit": str(model.dit),
            "layers": engine.rows.layers,
            "block": block,
            "cases": cases,
        }
    finally:
        loop.close()
        engine.shutdown()


def summary(cases: list[dict]) -> dict:
    pixels_max = [m for c in cases for m in c["pixels_max_abs"]]
    pixels_mean = [m for c in cases for m in c["pixels_mean_abs"]]
    return {
        "every_reused_row_bitwise_equal": all(c["reused_rows_bitwise_equal"] for c in cases),
        "every_two_misses_bitwise_equal": all(c["two_misses_bitwise_equal"] for c in cases),
        "cases_bitwise_equal": sum(c["rows_bitwise_equal"] for c in cases),
        "conditioning_max_abs_worst": max(c["conditioning_max_abs"] for c in cases),
        "conditioning_mean_abs_median": statistics.median(c["conditioning_mean_abs"] for c in cases),
        "conditioning_min_row_cosine": min(c["conditioning_min_row_cosine"] for c in cases),
        "pixels_max_abs_worst": max(pixels_max),
        "pixels_mean_abs": paired.spread(pixels_mean),
        "renders": len(pixels_max),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--models", default="qwen-image,demo")
    parser.add_argument("--out", type=Path, default=paired.RESULTS / "bf16_hit_miss.json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # bitwise-reproducible renders need a fixed thread count
    started = time.time()
    result: dict = {"machine": paired.machine(), "load_before": paired.load(), "seeds": args.seeds, "models": {}}
    for name in args.models.split(","):
        measured = measure(name, models()[name], args.seeds)
        measured["summary"] = summary(measured["cases"])
        result["models"][name] = measured
        print(name, json.dumps(measured["summary"], indent=1), flush=True)
    result["load_after"] = paired.load()
    result["seconds"] = round(time.time() - started, 1)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
