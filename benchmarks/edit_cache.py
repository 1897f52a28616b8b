"""What the AR's prefix cache saves an edit of Qwen-Image-Edit-2511: the same picture edited again with another
instruction against a fresh picture each time, on the tiny edit checkpoint, both services in this process.

An edit's prompt is the 64-token system prompt, the picture's tokens, then the instruction. A fresh picture ("cold")
misses after the system prompt; the same picture edited again ("same") hits every whole block of the system prompt,
picture and shared words, and its vision tower does not run (vLLM's encoder cache holds the picture). Per request:
the client's wall time (end to end), the AR's ``server-timing`` stages (``ar_total``: arrival to the ``cond``
stream's last row; ``negative_tail``: the negative prompt's run after it, with CFG), ``usage.cached_tokens``, and the
pictures the vision tower encoded (the AR's ``ardit_ar_pictures_encoded_total``, read before and after). Cold and
same alternate pair by pair in rotating order, so drift is shared; the figure is the per-pair ratio cold/same
(median, p10-p90). At c=1 a pair is one request of each; at c=8 it is a round of 8 concurrent requests of each,
the ratio that of the rounds' wall times (throughput) and of their median ``ar_total``.

The bound: the encoder's share ``f`` of one edit in diffusers' own ``QwenImageEditPlusPipeline`` in one process,
as ``encoder_share.py`` measures it for text-to-image: ``encode_prompt`` of the instruction and the picture (and of
the negative prompt with CFG), then ``__call__`` given those rows; a cache that skipped the whole encoder could make
an edit at most ``1 / (1 - f)`` times as fast. ``__call__``'s time is broken down (the transformer's steps, the VAE
encoding the picture at its 1024x1024 area, the VAE decode, the rest) by timing those modules' calls.

    python benchmarks/edit_cache.py [--dtypes float32,bfloat16] [--steps 4] [--pairs 8] [--rounds 2] \
        [--concurrency 1,8] [--bound-images 4]
"""

from __future__ import annotations

import argparse
import base64
import gc
import io
import json
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import diffusers
import httpx
import numpy as np
import paired
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
    CONDITION_IMAGE_SIZE,
    QwenImageEditPlusPipeline,
    calculate_dimensions,
)
from load import server_timing
from openai import OpenAI
from PIL import Image

paired.use_this_checkout()

from services.checkpoints import QWEN_IMAGE_EDIT_MODEL, default_model_dir  # noqa: E402
from services.model_card import QWEN_IMAGE_EDIT_PLUS  # noqa: E402

CARD = QWEN_IMAGE_EDIT_PLUS
SIZE = "64x64"
HANDOFF_TOKEN = "edit-cache-benchmark"
GUIDANCES: dict[str, float | None] = {"card_cfg": None, "no_cfg": 1.0}  # None: the card's (4.0, negative " ")
COLOURS = ["red", "blue", "green", "gold", "violet", "white", "black", "orange", "teal", "pink", "grey", "brown"]
THINGS = ["a boat", "a cat", "snow", "a moon", "a tree", "rain", "a bird", "a lamp", "a kite", "fog", "a tower"]


def picture(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 96, 3), dtype=np.uint8))


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def instruction(n: int) -> str:
    """A different instruction per ``n`` (which differs from its first word on, so only the picture is shared)."""
    return f"{COLOURS[n % len(COLOURS)]} sky, add {THINGS[n // len(COLOURS) % len(THINGS)]} (edit {n})"


# --- ardit: the pair in this process ----------------------------------------------------------------------


@contextmanager
def pair(folder: Path, dtype: str) -> Iterator[tuple[OpenAI, str]]:
    """Both services at their defaults on ``folder`` in this process; an OpenAI client of the AR and its URL."""
    from ar_service.app import create_ar_app
    from ar_service.settings import ArSettings
    from dit_service.app import create_dit_app
    from dit_service.settings import DitSettings
    from services.dtype import cpu_has_native_bf16
    from tests.support.live_server import LiveServer

    named = None if dtype == "bfloat16" and cpu_has_native_bf16() else dtype  # as the services' own default
    dit = LiveServer(create_dit_app(DitSettings(model_dir=folder, handoff_token=HANDOFF_TOKEN, dtype=named)))
    dit.start().wait_ready()
    settings = ArSettings(model_dir=folder, dit_url=dit.url, handoff_token=HANDOFF_TOKEN, dtype=named)
    ar = LiveServer(create_ar_app(settings)).start().wait_ready()
    try:
        yield OpenAI(base_url=f"{ar.url}/v1", api_key="-", max_retries=0, timeout=900), ar.url
    finally:
        ar.stop()
        dit.stop()


def pictures_encoded(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.search(r"^ardit_ar_pictures_encoded_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    if found is None:
        raise RuntimeError("the AR's metrics have no ardit_ar_pictures_encoded_total")
    return float(found.group(1))


def edit(client: OpenAI, image: Image.Image, prompt: str, steps: int, guidance: float | None) -> dict[str, Any]:
    extra: dict[str, Any] = {"seed": 1, "num_inference_steps": steps}
    if guidance is not None:
        extra["guidance_scale"] = guidance
    started = time.perf_counter()
    raw = client.images.with_raw_response.edit(
        image=[("p.png", png(image), "image/png")], prompt=prompt, size=SIZE, extra_body=extra
    )
    seconds = time.perf_counter() - started
    result = raw.parse()
    assert result.data is not None and base64.b64decode(result.data[0].b64_json or "")
    stages = server_timing(raw.headers.get("server-timing", ""))
    usage = result.usage.model_dump() if result.usage is not None else {}
    return {
        "e2e": seconds,
        "ar_total": stages.get("ar_total", float("nan")),
        "negative_tail": stages.get("negative_tail", 0.0),
        "dit_total": stages.get("dit_total", float("nan")),
        "stages": stages,
        "prompt_tokens": usage.get("input_tokens"),
        "image_tokens": (usage.get("input_tokens_details") or {}).get("image_tokens"),
        "cached_tokens": usage.get("cached_tokens"),
    }


class Traffic:
    """The two request classes: a fresh picture each time, or the one picture, each with a new instruction."""

    def __init__(self, client: OpenAI, url: str, steps: int, guidance: float | None, base: int) -> None:
        self.client, self.url, self.steps, self.guidance = client, url, steps, guidance
        self.next = base  # seeds of fresh pictures and instructions, never reused in a run
        self.same = picture(base - 1)

    def take(self) -> int:
        self.next += 1
        return self.next

    def one(self, kind: str) -> dict[str, Any]:
        n = self.take()
        image = picture(n) if kind == "cold" else self.same
        return edit(self.client, image, instruction(n), self.steps, self.guidance)

    def round(self, kind: str, clients: int) -> dict[str, Any]:
        before = pictures_encoded(self.url)
        jobs = [self.take() for _ in range(clients)]
        started = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            requests = list(
                pool.map(
                    lambda n: edit(
                        self.client,
                        picture(n) if kind == "cold" else self.same,
                        instruction(n),
                        self.steps,
                        self.guidance,
                    ),
                    jobs,
                )
            )
        return {
            "wall": time.perf_counter() - started,
            "pictures_encoded": pictures_encoded(self.url) - before,
            "requests": requests,
        }


def served(client: OpenAI, url: str, args: argparse.Namespace, guidance: float | None, base: int) -> dict[str, Any]:
    traffic = Traffic(client, url, args.steps, guidance, base)
    traffic.one("cold")  # warms this setting's path; not counted
    edit(client, traffic.same, instruction(base - 1), args.steps, guidance)  # puts the picture in the caches
    cells: dict[str, Any] = {}
    for clients in (int(c) for c in args.concurrency.split(",")):
        pairs: list[dict[str, Any]] = []
        for index in range(args.pairs if clients == 1 else args.rounds):
            order = ("cold", "same") if index % 2 == 0 else ("same", "cold")
            sides: dict[str, Any] = {}
            for kind in order:
                if clients == 1:
                    before = pictures_encoded(url)
                    request = traffic.one(kind)
                    request["pictures_encoded"] = pictures_encoded(url) - before
                    sides[kind] = request
                else:
                    sides[kind] = traffic.round(kind, clients)
            pairs.append(sides)
            print(f"  c={clients} pair {index}: {summary_line(sides, clients)}", flush=True)
        cells[f"c{clients}"] = summarise(pairs, clients)
    return cells


def summary_line(sides: dict[str, Any], clients: int) -> str:
    if clients == 1:
        return "  ".join(
            f"{k} e2e {s['e2e']:.2f}s ar {s['ar_total']:.3f}s cached {s['cached_tokens']} enc {s['pictures_encoded']:g}"
            for k, s in sides.items()
        )
    return "  ".join(f"{k} wall {s['wall']:.2f}s enc {s['pictures_encoded']:g}" for k, s in sides.items())


def summarise(pairs: list[dict[str, Any]], clients: int) -> dict[str, Any]:
    def per_kind(kind: str, pick: Callable[[dict[str, Any]], list[float]]) -> dict[str, float]:
        return paired.spread([v for p in pairs for v in pick(p[kind])])

    def requests(side: dict[str, Any]) -> list[dict[str, Any]]:
        return [side] if clients == 1 else side["requests"]

    out: dict[str, Any] = {"pairs": pairs}
    for kind in ("cold", "same"):
        out[kind] = {
            "e2e_seconds": per_kind(kind, lambda s: [r["e2e"] for r in requests(s)]),
            "ar_total_seconds": per_kind(kind, lambda s: [r["ar_total"] for r in requests(s)]),
            "negative_tail_seconds": per_kind(kind, lambda s: [r["negative_tail"] for r in requests(s)]),
            "ar_with_negative_seconds": per_kind(
                kind, lambda s: [r["ar_total"] + r["negative_tail"] for r in requests(s)]
            ),
            "dit_total_seconds": per_kind(kind, lambda s: [r["dit_total"] for r in requests(s)]),
            "cached_tokens": per_kind(kind, lambda s: [float(r["cached_tokens"]) for r in requests(s)]),
            "prompt_tokens": per_kind(kind, lambda s: [float(r["prompt_tokens"]) for r in requests(s)]),
            "image_tokens": per_kind(kind, lambda s: [float(r["image_tokens"]) for r in requests(s)]),
            "pictures_encoded_per_request": per_kind(kind, lambda s: [s["pictures_encoded"] / len(requests(s))]),
        }
        if clients > 1:
            out[kind]["round_wall_seconds"] = per_kind(kind, lambda s: [s["wall"]])

    def ar(side: dict[str, Any]) -> float:
        return statistics.median(r["ar_total"] + r["negative_tail"] for r in requests(side))

    if clients == 1:
        out["ratio_e2e"] = paired.spread([p["cold"]["e2e"] / p["same"]["e2e"] for p in pairs])
    else:
        out["ratio_round_wall"] = paired.spread([p["cold"]["wall"] / p["same"]["wall"] for p in pairs])
    out["ratio_ar"] = paired.spread([ar(p["cold"]) / ar(p["same"]) for p in pairs])
    return out


# --- the bound: diffusers' own pipeline in one process ----------------------------------------------------


class Clock:
    """Seconds spent in some modules' calls, wrapped on the instances (the pipeline calls them through ``self``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, owner: Any, attribute: str, name: str) -> None:
        inner = getattr(owner, attribute)

        def timed(*a: Any, **k: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

        setattr(owner, attribute, timed)

    def take(self) -> dict[str, float]:
        seconds, self.seconds = self.seconds, {}
        return seconds


def bound(folder: Path, dtype: str, steps: int, images: int) -> dict[str, Any]:
    pipe = QwenImageEditPlusPipeline.from_pretrained(str(folder), dtype=getattr(torch, dtype))
    pipe.set_progress_bar_config(disable=True)
    clock = Clock()
    clock.wrap(pipe.text_encoder, "forward", "text_encoder")
    clock.wrap(pipe.transformer, "forward", "transformer")
    clock.wrap(pipe.vae, "encode", "vae_encode")
    clock.wrap(pipe.vae, "decode", "vae_decode")
    width, height = (int(x) for x in SIZE.split("x"))
    cells: dict[str, Any] = {}
    for name, guidance in GUIDANCES.items():
        scale = guidance if guidance is not None else (CARD.default_guidance_scale or 1.0)
        samples: list[dict[str, float]] = []
        for index in range(-1, images):  # the first (index -1) warms up and is not counted
            image = picture(50_000 + index)
            w, h = calculate_dimensions(CONDITION_IMAGE_SIZE, image.width / image.height)
            condition: Any = [pipe.image_processor.resize(image, h, w)]  # annotated a tensor, takes pictures
            clock.take()
            started = time.perf_counter()
            with torch.inference_mode():
                embeds, mask = pipe.encode_prompt(
                    instruction(index + 1000), image=condition, device=torch.device("cpu")
                )
                cfg: dict[str, Any] = {}
                if scale > 1:
                    negative, negative_mask = pipe.encode_prompt(
                        CARD.default_negative_prompt or " ", image=condition, device=torch.device("cpu")
                    )
                    cfg = {
                        "negative_prompt_embeds": negative,
                        "negative_prompt_embeds_mask": negative_mask,
                        "true_cfg_scale": scale,
                    }
            encoded = time.perf_counter()
            encoder_modules = clock.take()
            pipe(
                image=[image],
                prompt_embeds=embeds,
                prompt_embeds_mask=mask,
                height=height,
                width=width,
                num_inference_steps=steps,
                generator=torch.Generator().manual_seed(1),
                output_type="pil",
                **({"true_cfg_scale": 1.0} | cfg),
            )
            rest = time.perf_counter() - encoded
            parts = clock.take()
            sample = {
                "encoder": encoded - started,
                "encoder_text_encoder_forward": encoder_modules.get("text_encoder", 0.0),
                "rest": rest,
                "transformer": parts.get("transformer", 0.0),
                "vae_encode": parts.get("vae_encode", 0.0),
                "vae_decode": parts.get("vae_decode", 0.0),
                "text_encoder_in_rest": parts.get("text_encoder", 0.0),  # 0: __call__ re-encodes nothing
                "conditioning_rows": float(embeds.shape[1]),
            }
            sample["other"] = rest - sample["transformer"] - sample["vae_encode"] - sample["vae_decode"]
            sample["share"] = sample["encoder"] / (sample["encoder"] + rest)
            if index >= 0:
                samples.append(sample)
        share = statistics.median(s["share"] for s in samples)
        cells[name] = {
            "guidance_scale": scale,
            **{
                f"{k}_seconds" if k not in ("share", "conditioning_rows") else k: paired.spread([s[k] for s in samples])
                for k in samples[0]
            },
            "most_a_prefix_cache_can_give": 1 / (1 - share),
        }
        print(f"  bound {name}: encoder {share:.1%} of an edit, at most {1 / (1 - share):.2f}x", flush=True)
    del pipe
    gc.collect()
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=default_model_dir(QWEN_IMAGE_EDIT_MODEL))
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=8, help="cold/same pairs at c=1")
    parser.add_argument("--rounds", type=int, default=2, help="cold/same pairs of rounds at c>1")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--bound-images", type=int, default=4)
    parser.add_argument("--out", type=Path, default=paired.RESULTS / "edit_cache.json")
    args = parser.parse_args()
    diffusers.utils.logging.set_verbosity_error()
    folder = args.model.expanduser()
    report: dict[str, Any] = {
        "command": "python benchmarks/edit_cache.py " + " ".join(sys.argv[1:]),
        "machine": paired.machine(),
        "load_before": paired.load(),
        "size": SIZE,
        "steps": args.steps,
        "cells": {},
    }
    for dtype in args.dtypes.split(","):
        print(f"{dtype}: the bound (diffusers, one process)", flush=True)
        cell: dict[str, Any] = {"bound": bound(folder, dtype, args.steps, args.bound_images), "served": {}}
        print(f"{dtype}: ardit (both services in this process)", flush=True)
        with pair(folder, dtype) as (client, url):
            for offset, (name, guidance) in enumerate(GUIDANCES.items()):
                print(f" {name}", flush=True)
                cell["served"][name] = served(client, url, args, guidance, base=100_000 * (offset + 1))
                cell["served"][name]["load"] = paired.load()
        for name, served_cell in cell["served"].items():
            speedup = served_cell["c1"]["ratio_e2e"]["p50"]
            most = cell["bound"][name]["most_a_prefix_cache_can_give"]
            cell["served"][name]["c1_speedup_over_bound"] = speedup / most
        report["cells"][dtype] = cell
    report["load_after"] = paired.load()
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
