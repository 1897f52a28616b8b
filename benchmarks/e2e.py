"""Where a request's time goes, end to end, through the public API of the real pair.

For a short and a long prompt, cold (prefix cache reset before each sample through the admin
endpoint; each sample must report cached_tokens = 0) and warm (the same prompt again; must report
the expected cached count), the AR's ``server-timing`` header gives the stages: queue, TTFT,
decode, handoff tail (AR's last row → DiT holds the conditioning), DiT queue, denoise, VAE
decode, encode, total. The whole matrix runs twice, with the handoff streamed while the AR
decodes and with rows sent only after the AR finishes, to show what the overlap saves.

Both services run as real processes (``python -m dit_service`` / ``python -m ar_service``) on
loopback ports, started by this script, one configuration after the other.

    python benchmarks/e2e.py [--samples 3] [--new-tokens 32] [--steps 8] [--size 64x64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import paired
import psutil
from PIL import Image, ImageDraw

RESULTS = Path(__file__).parent / "results"
STAGES = ["queue", "ttft", "decode", "handoff_tail", "dit_queue", "dit_denoise", "dit_vae_decode", "dit_encode"]
COLORS = ["#bbbbbb", "#1f77b4", "#aec7e8", "#d62728", "#dddddd", "#2ca02c", "#98df8a", "#ff7f0e"]
SHORT = "a red fox standing in fresh snow at sunrise, soft light"
LONG = ", ".join(["a detailed harbour scene with fishing boats, gulls, nets, ropes and old stone walls"] * 50)


def start_pair(overlap_handoff: bool) -> tuple[list[subprocess.Popen], str, str]:
    ar_port, dit_port = paired.free_port(), paired.free_port()
    admin = secrets.token_hex(8)
    env = dict(
        os.environ,
        ARDIT_HANDOFF_TOKEN=secrets.token_hex(8),
        ARDIT_AR_PORT=str(ar_port),
        ARDIT_DIT_PORT=str(dit_port),
        ARDIT_AR_DIT_URL=f"http://127.0.0.1:{dit_port}",
        ARDIT_AR_ADMIN_TOKEN=admin,
        ARDIT_AR_OVERLAP_HANDOFF=str(overlap_handoff).lower(),
        ARDIT_AR_MAX_PROMPT_TOKENS="1100",
        ARDIT_DIT_MAX_SEQUENCE_LENGTH="1024",
        ARDIT_AR_LOG_LEVEL="WARNING",
        ARDIT_DIT_LOG_LEVEL="WARNING",
    )
    procs = [
        paired.child([sys.executable, "-m", m], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for m in ("dit_service", "ar_service")
    ]
    url = f"http://127.0.0.1:{ar_port}"
    deadline = time.monotonic() + 900
    while True:
        try:
            if httpx.get(f"{url}/readyz").status_code == 200:
                return procs, url, admin
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError("the pair did not become ready")
        time.sleep(1)


def timings(header: str) -> dict[str, float]:
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        out[name] = float(dur)
    return out


def measure(url: str, admin: str, prompt: str, cold: bool, args: argparse.Namespace) -> list[dict]:
    samples = []
    body = {
        "prompt": prompt,
        "size": args.size,
        "seed": 1,
        "num_inference_steps": args.steps,
        "max_new_tokens": args.new_tokens,
    }
    if not cold:
        httpx.post(f"{url}/v1/images/generations", json=body, timeout=600).raise_for_status()  # fill the cache
    for _ in range(args.samples):
        if cold:
            httpx.post(
                f"{url}/admin/reset_prefix_cache", headers={"authorization": f"Bearer {admin}"}
            ).raise_for_status()
        response = httpx.post(f"{url}/v1/images/generations", json=body, timeout=600)
        response.raise_for_status()
        usage = response.json()["usage"]
        expected = 0 if cold else (usage["input_tokens"] - 1) // 128 * 128
        if usage["cached_tokens"] != expected:
            raise RuntimeError(
                f"{'cold' if cold else 'warm'} sample has cached_tokens={usage['cached_tokens']}, expected {expected}"
            )
        samples.append(timings(response.headers["server-timing"]) | {"prompt_tokens": usage["input_tokens"]})
    return samples


def plot(rows: list[tuple[str, dict[str, float]]], path: Path) -> None:
    """Stacked horizontal bars, one per configuration, stages in milliseconds (PIL, no plot library)."""
    width, bar_h, left, top = 1100, 26, 330, 40
    height = top + len(rows) * (bar_h + 12) + 80
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    scale = (width - left - 40) / max(sum(t.get(s, 0) for s in STAGES) for _, t in rows)
    draw.text((10, 10), "ardit end-to-end: median stage times (ms)", fill="black")
    for i, (label, t) in enumerate(rows):
        y = top + i * (bar_h + 12)
        draw.text((10, y + 7), label, fill="black")
        x: float = left
        for stage, color in zip(STAGES, COLORS, strict=True):
            w = t.get(stage, 0) * scale
            draw.rectangle([x, y, x + w, y + bar_h], fill=color)
            x += w
        draw.text((x + 4, y + 7), f"{t['total']:.0f}", fill="black")
    y = top + len(rows) * (bar_h + 12) + 10
    for j, (stage, color) in enumerate(zip(STAGES, COLORS, strict=True)):
        x = 10 + (j % 4) * 260
        yy = y + (j // 4) * 20
        draw.rectangle([x, yy, x + 14, yy + 14], fill=color)
        draw.text((x + 20, yy + 2), stage, fill="black")
    image.save(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--size", default="64x64")
    args = parser.parse_args()
    report: dict = {
        "command": f"python benchmarks/e2e.py --samples {args.samples} --new-tokens {args.new_tokens} "
        f"--steps {args.steps} --size {args.size}",
        "machine": {
            "node": platform.platform(),
            "cores": psutil.cpu_count(),
            "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "device": "cpu",
        },
        "runs": {},
    }
    medians: list[tuple[str, dict[str, float]]] = []
    for streaming in (True, False):
        procs, url, admin = start_pair(streaming)
        try:
            for prompt_name, prompt in (("short", SHORT), ("long", LONG)):
                for cold in (True, False):
                    key = f"{'stream' if streaming else 'after-AR'} {prompt_name} {'cold' if cold else 'warm'}"
                    samples = measure(url, admin, prompt, cold, args)
                    median = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
                    report["runs"][key] = {"samples": samples, "median_ms": median}
                    medians.append((key, median))
                    print(key, json.dumps({k: round(v, 1) for k, v in median.items()}), flush=True)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(timeout=60)
    report["streaming_saves_ms"] = {
        key.removeprefix("stream "): report["runs"][f"after-AR {key.removeprefix('stream ')}"]["median_ms"]["total"]
        - report["runs"][key]["median_ms"]["total"]
        for key in report["runs"]
        if key.startswith("stream ")
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "e2e.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(medians, RESULTS / "e2e_breakdown.png")
    print(json.dumps(report["streaming_saves_ms"], indent=2))


if __name__ == "__main__":
    main()
