"""DiT request batching: images per minute at concurrency 1, 4 and 8, with and without batching.

Two DiT processes (``python -m dit_service``) on the same model, one with batching off
(``ARDIT_DIT_BATCH_MAX_SIZE=1``, the default) and one on (``--batch-size``, window ``--window-ms``),
each given the same pipeline queue so concurrency 8 is admitted by both. Clients post complete
handoffs (the wire contract's frames, rows of random conditioning of a typical prompt's length)
straight to the DiT and read the images back. Each cell runs on both configurations back to back,
which goes first alternating, so the machine's drift hits both. Ratios (on/off) are per round:
median, p10-p90.

    python benchmarks/dit_batching.py [--model DIR] [--size 256x256] [--steps 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import paired

paired.use_this_checkout()

import torch  # noqa: E402

from services.checkpoints import PLUMBING_DIT_MODEL, default_model_dir  # noqa: E402
from shared.diffusion import DiffusionParams  # noqa: E402
from shared.frames import OpenFrame, StreamSpec  # noqa: E402
from shared.handoff_encoder import HandoffEncoder  # noqa: E402
from shared.result_frames import HANDOFF_MEDIA_TYPE, ImageFrame, ResultReader  # noqa: E402
from shared.row_recipe import RowRecipe  # noqa: E402

TOKEN = "bench-token"
ROWS = 24  # a short prompt's conditioning rows


def start(model: Path, batch: int, window_ms: float, queue: int) -> tuple[subprocess.Popen[bytes], str]:
    port = paired.free_port()
    env = dict(
        os.environ,
        ARDIT_DIT_MODEL_DIR=str(model),
        ARDIT_DIT_PORT=str(port),
        ARDIT_HANDOFF_TOKEN=TOKEN,
        ARDIT_DIT_BATCH_MAX_SIZE=str(batch),
        ARDIT_DIT_BATCH_WINDOW_MS=str(window_ms),
        ARDIT_DIT_PIPELINE_QUEUE_SIZE=str(queue),
        ARDIT_DIT_LOG_LEVEL="WARNING",
    )
    process = paired.child([sys.executable, "-m", "dit_service"], env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError("the DiT did not start")
        time.sleep(0.5)


def handoff(seed: int, hidden: int, width: int, height: int, steps: int) -> bytes:
    """A complete handoff of ROWS random rows, written with the contract's own encoder."""
    rows = torch.randn(ROWS, hidden, generator=torch.Generator().manual_seed(seed))
    token_ids = list(range(100, 100 + ROWS))
    encoder = HandoffEncoder(
        OpenFrame(
            request_id=f"bench-{seed}-{time.monotonic_ns()}",
            model="bench",
            dtype="float32",
            row_width=hidden,
            rows=RowRecipe(layers=[30]),
            streams={"cond": StreamSpec(prompt_tokens=ROWS, max_rows=ROWS, prefix_tokens=0)},
            diffusion=DiffusionParams(
                width=width, height=height, num_inference_steps=steps, guidance_scale=1.0, seed=seed
            ),
        )
    )
    parts = [*encoder.open_frame(), *encoder.rows("cond", 0, token_ids, rows)]
    parts += encoder.close({"cond": token_ids}, {"cond": ROWS}, cached_tokens=0, cache_creation_tokens=0)
    return b"".join(bytes(part) for part in parts)


def one(url: str, seed: int, hidden: int, width: int, height: int, steps: int) -> float:
    body = handoff(seed, hidden, width, height, steps)
    headers = {"authorization": f"Bearer {TOKEN}", "content-type": HANDOFF_MEDIA_TYPE}
    started = time.monotonic()
    answer = httpx.post(f"{url}/v1/handoff", content=body, headers=headers, timeout=600)
    frames = list(ResultReader().feed(answer.content)) if answer.status_code == 200 else []
    if not any(isinstance(frame, ImageFrame) for frame in frames):
        raise RuntimeError(f"the DiT answered {answer.status_code}: {answer.text[:200]}")
    return time.monotonic() - started


def burst(url: str, concurrency: int, images: int, hidden: int, width: int, height: int, steps: int) -> dict:
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        latencies = list(pool.map(lambda s: one(url, s, hidden, width, height, steps), range(images)))
    wall = time.monotonic() - started
    return {
        "images_per_minute": 60 * images / wall,
        "p50_seconds": statistics.median(latencies),
        "max_seconds": max(latencies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=default_model_dir(PLUMBING_DIT_MODEL))
    parser.add_argument("--size", default="256x256")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--window-ms", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--images", type=int, default=16, help="images per measurement")
    parser.add_argument("--out", type=Path, default=paired.RESULTS / "dit_batching.json")
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    hidden = json.loads((args.model / "transformer" / "config.json").read_text())["joint_attention_dim"]
    configs = {"off": 1, "on": args.batch_size}
    load_before = paired.load()
    servers = {name: start(args.model, batch, args.window_ms, queue=16) for name, batch in configs.items()}
    runs: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in (1, 4, 8)} for name in configs}
    try:
        for _, url in servers.values():
            one(url, 0, hidden, width, height, args.steps)  # warm
        for round_ in range(args.rounds):
            for concurrency in (1, 4, 8):
                order = list(servers.items())
                for name, (_, url) in order if (round_ + concurrency) % 2 else order[::-1]:
                    result = burst(url, concurrency, args.images, hidden, width, height, args.steps)
                    runs[name][concurrency].append(result | {"load_1m": paired.load()["load_1m"]})
                    print(name, concurrency, json.dumps(result), flush=True)
    finally:
        for process, _ in servers.values():
            process.send_signal(signal.SIGINT)
            process.wait(60)
    summary = {}
    for concurrency in (1, 4, 8):
        off, on = runs["off"][concurrency], runs["on"][concurrency]
        summary[f"concurrency {concurrency}"] = {
            "off_images_per_minute": paired.spread([r["images_per_minute"] for r in off]),
            "on_images_per_minute": paired.spread([r["images_per_minute"] for r in on]),
            "on/off images_per_minute": paired.spread(
                [b["images_per_minute"] / a["images_per_minute"] for a, b in zip(off, on, strict=True)]
            ),
            "on/off latency_p50": paired.spread(
                [b["p50_seconds"] / a["p50_seconds"] for a, b in zip(off, on, strict=True)]
            ),
        }
    result = {
        "command": "python benchmarks/dit_batching.py " + " ".join(sys.argv[1:]),
        "machine": paired.machine(),
        "load_before": load_before,
        "load_after": paired.load(),
        "model": str(args.model.name),
        "size": args.size,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "window_ms": args.window_ms,
        "summary": summary,
        "runs": runs,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
