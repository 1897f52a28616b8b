"""64 clients at once against `make run`'s pair at its default settings, then a burst 3x past capacity.

The launcher (``python -m services.launcher``) starts both services exactly as ``make run`` does,
on free loopback ports. Then ``--clients`` requests (distinct seeds, ``--size``, ``--steps``) are
sent at the same moment, ``--rounds`` times. Reported: status counts (no 503 may appear; a 429
must come back in under 100 ms), throughput, latency p10/p50/p90/p99, and the queue wait
distribution (the AR's ``server-timing`` ``queue`` stage: arrival to engine submission, which is
the admission wait plus a few ms).

The last round, "3x over capacity", sizes a burst from what the pair says of itself after those
rounds: what admission takes of a burst at once at its measured pace (``ardit_ar_admission_seconds_per_*``,
``ar_service.admission.admitted_at_once``); the burst is three times that, all at once. Every answer must be a
200 or a 429; the round reports both latency distributions and a histogram by status.

    python benchmarks/load.py [--clients 64] [--rounds 3] [--size 64x64] [--steps 2] [--over 3]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import math
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
from burst_client import burst_at_once, request

paired.use_this_checkout()

from ar_service import ArSettings  # noqa: E402
from ar_service.admission import admitted_at_once  # noqa: E402
from shared.capabilities import DitCapabilities, Load, Pace  # noqa: E402
from shared.diffusion import parse_size  # noqa: E402

RESULTS = Path(__file__).parent / "results"
# Upper bounds of the latency histogram of the over-capacity round, in seconds.
HISTOGRAM_BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 1, 10, 30, 60, 120, 300, math.inf)


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
    parser.add_argument("--over", type=float, default=3.0, help="the burst, as a multiple of what can be served")
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
    launcher = paired.child([sys.executable, "-m", "services.launcher"], env=env, stdout=subprocess.DEVNULL)
    try:
        paired.wait_ready(url, launcher)
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
        over = asyncio.run(over_capacity(url, f"http://127.0.0.1:{dit_port}", args.over, args.size, args.steps))
        print(json.dumps({k: v for k, v in over.items() if k != "histogram"}))
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
        "over_capacity": over,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise LookupError(name)


async def over_capacity(ar_url: str, dit_url: str, over: float, size: str, steps: int) -> dict:
    """A burst of ``over`` x what the pair can serve within its maximum wait, all at once."""
    settings = ArSettings()
    dit = DitCapabilities.model_validate(httpx.get(f"{dit_url}/readyz", timeout=10).json()["capabilities"])
    capacity = dit.capacity.max_outstanding
    pace = Pace(
        per_request=metric(ar_url, "ardit_ar_admission_seconds_per_request"),
        per_megapixel=metric(ar_url, "ardit_ar_admission_seconds_per_megapixel"),
        per_work=metric(ar_url, "ardit_ar_admission_seconds_per_work"),
    )
    width, height = parse_size(size)
    params = dit.defaults.params().model_copy(update={"width": width, "height": height, "num_inference_steps": steps})
    servable = admitted_at_once(
        capacity, settings.max_queued_requests, settings.max_queue_wait_seconds, pace, Load.of(params)
    )
    burst = math.ceil(over * servable)
    results = await burst_at_once(ar_url, [request(10_000 + i, size, steps) for i in range(burst)])
    wall = max(seconds for _, seconds in results)  # until the burst's last answer
    by_status: dict[str, list[float]] = {}
    for status, seconds in results:
        by_status.setdefault(str(status), []).append(seconds)
    refused = by_status.get("429", [])
    histogram = {
        status: {f"<= {bound:g} s": sum(1 for s in seconds if s <= bound and s > low) for low, bound in _bands()}
        for status, seconds in by_status.items()
    }
    return {
        "sizing": {
            "capacity": capacity,
            "pace": pace.model_dump(),
            "max_queue_wait_seconds": settings.max_queue_wait_seconds,
            "max_queued_requests": settings.max_queued_requests,
            "servable": servable,
            "burst": burst,
        },
        "wall_seconds": wall,
        "statuses": {status: len(seconds) for status, seconds in by_status.items()},
        "latency_200_seconds": quantiles(by_status.get("200", [])),
        "latency_429_seconds": quantiles(refused),
        "refused_in_100_ms": sum(1 for s in refused if s < 0.1),
        "neither_200_nor_429": sum(1 for status, _ in results if status not in (200, 429)),
        "histogram": histogram,
    }


def _bands() -> list[tuple[float, float]]:
    return list(zip((-math.inf, *HISTOGRAM_BOUNDS[:-1]), HISTOGRAM_BOUNDS, strict=True))


if __name__ == "__main__":
    main()
