"""64 clients at once against `make run`'s pair at its default settings.

The launcher (``python -m services.launcher``) starts both services exactly as ``make run`` does,
on free loopback ports. Then ``--clients`` requests (distinct seeds, ``--size``, ``--steps``) are
sent at the same moment, ``--rounds`` times. Reported: status counts (no 503 may appear; a 429
must come back in under 100 ms), throughput, latency p10/p50/p90/p99, and the queue wait
distribution (the AR's ``server-timing`` ``queue`` stage: arrival to engine submission, which is
the admission wait plus a few ms).

    python benchmarks/load.py [--clients 64] [--rounds 3] [--size 64x64] [--steps 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import paired

RESULTS = Path(__file__).parent / "results"


def quantiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {"p50": values[0] if values else float("nan")}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p10": cuts[9], "p50": statistics.median(values), "p90": cuts[89], "p99": cuts[98], "max": max(values)}


def server_timing(header: str) -> dict[str, float]:
    stages = {}
    for part in header.split(","):
        name, _, duration = part.strip().partition(";dur=")
        if duration:
            stages[name] = float(duration) / 1000
    return stages


def one(url: str, seed: int, size: str, steps: int) -> dict:
    started = time.monotonic()
    response = httpx.post(
        f"{url}/v1/images/generations",
        json={"prompt": f"a red square number {seed % 8}", "size": size, "seed": seed, "num_inference_steps": steps},
        timeout=900,
    )
    return {
        "status": response.status_code,
        "seconds": time.monotonic() - started,
        "stages": server_timing(response.headers.get("server-timing", "")),
        "retry_after": response.headers.get("retry-after"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", default="64x64")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "load.json")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]

    ar_port, dit_port = paired.free_port(), paired.free_port()
    env = dict(
        os.environ,
        ARDIT_AR_PORT=str(ar_port),
        ARDIT_DIT_PORT=str(dit_port),
        ARDIT_AR_LOG_LEVEL="WARNING",
        ARDIT_DIT_LOG_LEVEL="WARNING",
    )
    url = f"http://127.0.0.1:{ar_port}"
    launcher = subprocess.Popen([sys.executable, "-m", "services.launcher"], env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 900
        while not _ready(url):
            if time.monotonic() > deadline or launcher.poll() is not None:
                raise RuntimeError("the pair did not become ready")
            time.sleep(1)
        one(url, 0, args.size, args.steps)  # warm
        rounds = []
        for round_index in range(args.rounds):
            seeds = [round_index * args.clients + i for i in range(args.clients)]
            started = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
                results = list(pool.map(lambda s: one(url, s, args.size, args.steps), seeds))
            wall = time.monotonic() - started
            ok = [r for r in results if r["status"] == 200]
            rounds.append(
                {
                    "wall_seconds": wall,
                    "statuses": dict(Counter(str(r["status"]) for r in results)),
                    "images_per_second": len(ok) / wall,
                    "latency_seconds": quantiles([r["seconds"] for r in ok]),
                    "queue_wait_seconds": quantiles([r["stages"].get("queue", 0.0) for r in ok]),
                    "slowest_429_seconds": max((r["seconds"] for r in results if r["status"] == 429), default=None),
                }
            )
            print(json.dumps(rounds[-1]))
    finally:
        launcher.send_signal(signal.SIGINT)
        launcher.wait(120)
    result = {
        "command": "python benchmarks/load.py " + " ".join(sys.argv[1:]),
        "settings": "make run defaults (launcher), ports only changed",
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_1m_before": load_before,
        },
        "clients": args.clients,
        "size": args.size,
        "steps": args.steps,
        "rounds": rounds,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


if __name__ == "__main__":
    main()
