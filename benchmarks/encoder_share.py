"""How much of one image a prefix cache can save at most: the text encoder's share of an image in diffusers' own
Qwen-Image pipeline, on the folder and prompts ``vllm_omni_table.py`` serves.

A prefix cache skips (part of) the text encoder's prefill and nothing else: the transformer's steps and the VAE
cost the same whatever the conditioning's provenance. If the encoder is a fraction ``f`` of an image, a system
that skips all of it is at most ``1 / (1 - f)`` times as fast as one that runs it in full, however fast the rest.
This measures ``f`` in one process (no serving, no handoff): ``encode_prompt`` alone, then ``__call__`` with the
embeddings it made (the transformer's steps, the VAE), each timed per image, in arrival order of the same
shared-prefix and unique prompts as ``peer_compare.py``, at each size.

    python benchmarks/encoder_share.py [--dtypes bfloat16,float32] [--sizes 64x64,256x256] [--steps 20] [--images 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import diffusers
import paired
import torch
from diffusers import QwenImagePipeline
from peer_compare import prompt

MODEL = Path("~/.cache/ardit/models/qwen-image-full-tiny")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--sizes", default="64x64,256x256")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--out", type=Path, default=paired.RESULTS / "encoder_share.json")
    args = parser.parse_args()
    diffusers.utils.logging.set_verbosity_error()  # a mask of all ones comes back as None, and is warned about
    report: dict = {
        "command": "python benchmarks/encoder_share.py " + " ".join(sys.argv[1:]),
        "machine": paired.machine(),
        "load_before": paired.load(),
        "cells": {},
    }
    for dtype in args.dtypes.split(","):
        pipe = QwenImagePipeline.from_pretrained(args.model.expanduser(), torch_dtype=getattr(torch, dtype))
        pipe.set_progress_bar_config(disable=True)
        for size in args.sizes.split(","):
            width, height = (int(x) for x in size.split("x"))
            for traffic in ("shared_prefix", "unique"):
                encoder, rest, tokens = [], [], []
                for index in range(-1, args.images):  # the first (index -1) warms up and is not counted
                    text = prompt(traffic, max(index, 0) + 1000)
                    started = time.perf_counter()
                    with torch.inference_mode():
                        embeds, mask = pipe.encode_prompt(text, device="cpu")
                    encoded = time.perf_counter()
                    pipe(
                        prompt_embeds=embeds,
                        prompt_embeds_mask=mask,
                        width=width,
                        height=height,
                        num_inference_steps=args.steps,
                        true_cfg_scale=1.0,
                        generator=torch.Generator().manual_seed(max(index, 0)),
                        output_type="pil",
                    )
                    seconds, took = encoded - started, time.perf_counter() - encoded
                    if index >= 0:
                        encoder.append(seconds)
                        rest.append(took)
                        tokens.append(int(embeds.shape[1]))
                shares = [e / (e + r) for e, r in zip(encoder, rest, strict=True)]
                share = statistics.median(shares)
                report["cells"][f"{dtype} {size} {traffic}"] = {
                    "conditioning_rows": statistics.median(tokens),
                    "encoder_seconds": paired.spread(encoder),
                    "transformer_and_vae_seconds": paired.spread(rest),
                    "encoder_share": paired.spread(shares),
                    "most_a_prefix_cache_can_give": 1 / (1 - share),
                }
                print(
                    f"{dtype} {size} {traffic}: encoder {share:.1%} of an image, at most {1 / (1 - share):.2f}x",
                    flush=True,
                )
    report["load_after"] = paired.load()
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
