"""Cancelled renders with a step cache leave the DiT's memory where it was: its RSS before and after N of them.

Each request asks for a long render (``--steps``) at the model card's default step cache and gives up after
``--give-up`` seconds, so the client's connection closes mid-denoise; the AR aborts the handoff and the DiT stops
the render, which must drop the cache hook's state with it. The DiT's resident memory (its own
``process_resident_memory_bytes``) is read after a few full renders (so the allocator has grown to its working
size), again once the cancelled ones have gone, and after as many renders that run to their end (the control: what
renders do to RSS anyway); the step-cache pass counters show how far the cancelled renders got.

Start the services with the demo model first (``make run``), then::

    python -m benchmarks.step_cache_cancellation [--requests 100] [--give-up SECONDS] [--steps 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx
from openai import AsyncOpenAI, OpenAI
from prometheus_client.parser import text_string_to_metric_families

RESULTS = Path(__file__).parent / "results"
PROMPT = "a red square on a blue background, in the top left"


BUSY = ("ardit_dit_handoffs_in_flight", "ardit_dit_pipeline_queue_depth", "ardit_dit_pipeline_runs_in_flight")
RSS = "process_resident_memory_bytes"
PASSES = "ardit_dit_step_cache_passes_total"


def dit_metrics(url: str) -> dict[str, float]:
    """The step-cache pass counters, the RSS and what the DiT is busy with, by ``name{labels}``."""
    values = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            if sample.name in (*BUSY, RSS, PASSES):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


def mb(nbytes: float) -> float:
    return round(nbytes / 2**20, 1)


def idle(url: str, timeout: float = 120.0) -> None:
    """Wait until the DiT receives, queues and renders nothing (the cancelled renders have stopped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(v for k, v in dit_metrics(url).items() if k.split("{")[0] in BUSY):
            return
        time.sleep(0.5)
    raise RuntimeError("the DiT is still busy")


async def give_up(args: argparse.Namespace, extra: dict[str, int]) -> int:
    """Send ``args.requests`` renders one after another, each abandoned ``args.give_up`` s after it was sent (a
    wall-clock deadline: the client's own timeout restarts with every byte); how many were abandoned."""
    client = AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=600)
    abandoned = 0
    for seed in range(args.requests):
        body = {**extra, "seed": seed}
        try:
            async with asyncio.timeout(args.give_up):
                await client.images.generate(model="ardit", prompt=PROMPT, size="64x64", extra_body=body)
        except TimeoutError:
            abandoned += 1
    await client.close()
    return abandoned


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--dit-metrics", default="http://127.0.0.1:8001/metrics")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"))
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument(
        "--give-up",
        type=float,
        default=None,
        help="seconds before the client closes its connection (default: half a warm-up render's, so that most "
        "renders are cut part-way through the denoise, with the cache's state built up)",
    )
    ap.add_argument("--steps", type=int, default=100, help="num_inference_steps: long enough to be cut short")
    ap.add_argument("--warm-up", type=int, default=5, help="full renders before the first reading")
    ap.add_argument("--out", type=Path, default=RESULTS / "step_cache_cancellation.json")
    args = ap.parse_args()
    load_before = os.getloadavg()
    full = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=600)
    extra = {"num_inference_steps": args.steps}  # and the card's step cache: the request names none
    whole = []
    for seed in range(args.warm_up):
        started = time.perf_counter()
        full.images.generate(model="ardit", prompt=PROMPT, size="64x64", extra_body={**extra, "seed": seed})
        whole.append(time.perf_counter() - started)
    # Measured rather than fixed: a 100-step render's time varies from one run to the next on a shared 2-core
    # machine (benchmarks/results/step_cache.md).
    args.give_up = args.give_up or statistics.median(whole) / 2
    idle(args.dit_metrics)
    readings = [dit_metrics(args.dit_metrics)]
    gave_up = asyncio.run(give_up(args, extra))
    idle(args.dit_metrics)
    time.sleep(2.0)  # anything the cancelled renders freed is back with the allocator
    readings.append(dit_metrics(args.dit_metrics))
    # The control: as many renders, each to its end, so what renders do to RSS anyway is seen beside it.
    for seed in range(args.requests):
        full.images.generate(model="ardit", prompt=PROMPT, size="64x64", extra_body={**extra, "seed": seed})
    idle(args.dit_metrics)
    time.sleep(2.0)
    readings.append(dit_metrics(args.dit_metrics))
    result = {
        "command": "python -m benchmarks.step_cache_cancellation " + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "requests": args.requests,
        "gave_up": gave_up,
        "give_up_seconds": round(args.give_up, 3),
        "num_inference_steps": args.steps,
        "dit_rss_mb": [mb(r[RSS + "{}"]) for r in readings],
        "dit_rss_change_mb": {
            "over_the_cancelled_renders": mb(readings[1][RSS + "{}"] - readings[0][RSS + "{}"]),
            "over_as_many_whole_renders_after": mb(readings[2][RSS + "{}"] - readings[1][RSS + "{}"]),
        },
        "step_cache_passes_of_the_cancelled_renders": {
            k: readings[1][k] - readings[0][k]
            for k in readings[1]
            if k.startswith(PASSES) and readings[1][k] != readings[0][k]
        },
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
