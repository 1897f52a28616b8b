"""Step caches on the demo model, through the running services: denoise speed-up and quality cost against no cache.

For every prompt and seed of the prompt-following benchmark (``prompt_following.py``: the same fixed prompts, the
same judge), each setting renders the same request — same prompt, seed, steps and guidance — one after another, so
load drifts over all settings alike. Per setting: the DiT's denoise time (its ``dit_denoise`` server-timing stage)
as a ratio to the uncached render of the same request (median and p10-p90 over requests), the judge's accuracy
per attribute, and PSNR / SSIM of the picture against the uncached one.

Start the services with the demo model first (``make run``), then::

    python -m benchmarks.step_cache [--base-url http://127.0.0.1:8000/v1] [--seen 40] [--seeds 2]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from openai import OpenAI
from PIL import Image

from benchmarks.prompt_following import ATTRIBUTES, accuracy, benchmark_prompts, correct
from benchmarks.prompt_judge import judge

RESULTS = Path(__file__).parent / "results"
# The settings measured: diffusers' two hooks that run on the Qwen-Image transformer (first block cache and
# TaylorSeer), each at three strengths. Tried and left out: PyramidAttentionBroadcast fails on Qwen-Image's
# joint attention when the negative prompt's length differs from the prompt's; SeaCache and the text K/V cache
# gave pictures bitwise equal to uncached (they did not engage on this model).
SETTINGS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "first_block 0.05": {"method": "first_block", "threshold": 0.05},
    "first_block 0.1": {"method": "first_block", "threshold": 0.1},
    "first_block 0.2": {"method": "first_block", "threshold": 0.2},
    "taylorseer 2": {"method": "taylorseer", "interval": 2},
    "taylorseer 3": {"method": "taylorseer", "interval": 3},
    "taylorseer 4": {"method": "taylorseer", "interval": 4},
}


def render(
    client: OpenAI, prompt: str, seed: int, steps: int, cache: dict[str, Any] | None
) -> tuple[Image.Image, float]:
    """The picture, and the DiT's denoise seconds."""
    step_cache = cache or {"method": "none"}
    extra = {"seed": seed, "num_inference_steps": steps, "step_cache": step_cache}
    raw = client.images.with_raw_response.generate(model="ardit", prompt=prompt, size="64x64", extra_body=extra)
    stages = dict(part.strip().split(";dur=") for part in raw.headers["server-timing"].split(","))
    result = raw.parse()
    assert result.data and result.data[0].b64_json is not None
    picture = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).convert("RGB")
    return picture, float(stages["dit_denoise"]) / 1000


def psnr(picture: np.ndarray, reference: np.ndarray) -> float:
    """dB over 8-bit RGB; identical pictures are reported as infinity."""
    mse = float(np.mean((picture.astype(np.float64) - reference.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def ssim(picture: np.ndarray, reference: np.ndarray) -> float:
    """SSIM (Wang et al. 2004: 11x11 Gaussian window, sigma 1.5, K1 0.01, K2 0.03) of the luma, averaged over the
    picture. Written here rather than pulling scikit-image and SciPy into the pins for one formula."""
    luma = [
        torch.from_numpy(p.astype(np.float64) @ np.array([0.299, 0.587, 0.114]))[None, None]
        for p in (picture, reference)
    ]
    x = torch.arange(11, dtype=torch.float64) - 5
    g = torch.exp(-(x**2) / (2 * 1.5**2))
    window = (g[:, None] * g[None, :] / g.sum() ** 2)[None, None]

    def blur(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.conv2d(t, window)

    a, b = luma
    mu_a, mu_b = blur(a), blur(b)
    var_a, var_b, cov = blur(a * a) - mu_a**2, blur(b * b) - mu_b**2, blur(a * b) - mu_a * mu_b
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    value = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return float(value.mean())


def spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[round(q * (len(ordered) - 1))]

    return {"p10": round(at(0.1), 3), "p50": round(statistics.median(ordered), 3), "p90": round(at(0.9), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"))
    ap.add_argument("--steps", type=int, default=20, help="num_inference_steps (the model card's default)")
    ap.add_argument("--seen", type=int, default=40, help="prompts of trained combinations")
    ap.add_argument("--seeds", type=int, default=2, help="seeds per prompt")
    ap.add_argument("--out", type=Path, default=RESULTS / "step_cache.json")
    args = ap.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=120)
    model = client.models.retrieve("ardit").model_dump()
    load_at_start = os.getloadavg()
    started = time.perf_counter()
    rows: dict[str, dict[str, list]] = {
        name: {"speedup": [], "psnr": [], "ssim": [], "scores": []} for name in SETTINGS
    }
    for prompt, asked in benchmark_prompts(args.seen, 0):
        for seed in range(args.seeds):
            reference: np.ndarray | None = None
            uncached_seconds = 0.0
            for name, cache in SETTINGS.items():
                picture, seconds = render(client, prompt, seed, args.steps, cache)
                pixels = np.asarray(picture)
                if reference is None:
                    reference, uncached_seconds = pixels, seconds
                row = rows[name]
                row["speedup"].append(uncached_seconds / seconds)
                row["psnr"].append(psnr(pixels, reference))
                row["ssim"].append(ssim(pixels, reference))
                row["scores"].append(correct(judge(picture), asked))
    seconds = time.perf_counter() - started

    table: dict[str, dict[str, Any]] = {}
    for name, row in rows.items():
        finite = [p for p in row["psnr"] if math.isfinite(p)]
        table[name] = {
            "step_cache": SETTINGS[name],
            "denoise_speedup": spread(row["speedup"]),
            "accuracy": accuracy(row["scores"]),
            "psnr_db": spread(finite) if finite else "identical",
            "identical_pictures": len(row["psnr"]) - len(finite),
            "ssim": spread(row["ssim"]),
        }
    report = {
        "command": "python -m benchmarks.step_cache " + " ".join(sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average_at_start": load_at_start,
            "load_average_at_end": os.getloadavg(),
        },
        "model": model["id"],
        "num_inference_steps": args.steps,
        "guidance_scale": "the model card's",
        "size": "64x64",
        "renders_per_setting": len(rows["none"]["scores"]),
        "seconds": round(seconds, 1),
        "settings": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, entry in table.items():
        acc = " ".join(f"{a} {entry['accuracy'][a]:.3f}" for a in ATTRIBUTES)
        print(f"{name:18s} speed-up {entry['denoise_speedup']} {acc} psnr {entry['psnr_db']} ssim {entry['ssim']}")
    print(f"{report['renders_per_setting']} renders per setting in {seconds:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
