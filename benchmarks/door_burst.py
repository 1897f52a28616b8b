"""A burst of refusals at the AR's admission door (its outermost ASGI layer), timed.

A server runs as the AR's public port runs (``services.serve.server``, the services' logging) with the door in
front of a small app and its line full, so that every request is refused. Each repetition sends a burst of
each size in ``--bursts`` at once with the client ``tests/e2e/test_load.py`` uses, and records each refusal's
latency (request written → status line read), the slowest, the p99 and the server's CPU time per refusal,
with the machine's load. The default sizes: 500, and 783, three times what ``make run``'s pair served within
its longest wait on 2026-12-04 (the burst ``test_load.py`` sent then).

``--versus DIR`` adds a second server in the same rotation: the door of another checkout of this repository,
served by its own ``benchmarks/door_burst.py --serve SIDE`` (``--versus-side protocol`` for a checkout before
the door moved out of uvicorn's HTTP protocol, 0f96938 and older), with the ratios door / versus.

    python benchmarks/door_burst.py [--bursts 500,783] [--reps 10] [--versus DIR [--versus-side door]]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import paired

paired.use_this_checkout()

RESULTS = paired.RESULTS / "door_burst.json"
SIDES = ("door",)


def serve(side: str, port: int) -> None:
    """The door's server, its line full, until it is stopped."""
    from prometheus_client import CollectorRegistry
    from starlette.types import ASGIApp

    from ar_service.admission import RequestAdmission
    from ar_service.api.admission_door import AdmissionDoor
    from ar_service.metrics import ArMetrics
    from services.app import Readiness, create_app
    from services.auth import BearerAuth
    from services.drain import Drain
    from services.fatal import Fatal
    from services.heap import freeze_startup_heap
    from services.request_context import configure_logging
    from services.serve import server
    from shared.capabilities import DiffusionDefaults, DiffusionLimits, DitCapabilities, DitCapacity

    configure_logging("ar")

    limits = DiffusionLimits(
        size_multiple=16,
        max_pixels=1 << 20,
        min_inference_steps=1,
        max_inference_steps=100,
        max_guidance_scale=10.0,
        max_images=1,
        max_conditioning_rows=512,
        output_formats=["png"],
    )
    defaults = DiffusionDefaults(width=64, height=64, num_inference_steps=20, guidance_scale=1.0)
    capacity = DitCapacity(max_concurrent_handoffs=1, max_pipeline_runs=1, pipeline_queue_size=0)
    dit = DitCapabilities(
        model="door-burst",
        description="none",
        row_width=8,
        conditioning=["qwen_image"],
        limits=limits,
        defaults=defaults,
        capacity=capacity,
    )

    class Full:
        """The pair's readiness as the door sees it: known, with no slot (every request refused)."""

        def known(self) -> tuple[DitCapabilities, int]:
            return dit, 0

    metrics = ArMetrics(CollectorRegistry())
    drain = Drain(10.0)

    def door(app: ASGIApp) -> ASGIApp:
        return AdmissionDoor(
            app,
            admission=RequestAdmission(0, 120.0, metrics),
            readiness=Full(),  # type: ignore[arg-type]
            paths=["/v1/images/generations"],
            auth=BearerAuth([], what="API key", missing_code="missing_api_key", invalid_code="invalid_api_key"),
            drain=drain,
            metrics=metrics.app,
            internal_port=None,
        )

    async def ready() -> Readiness:
        return Readiness(True, "ready")

    app = create_app(
        "door_burst", lifespan=None, readiness=ready, app_metrics=metrics.app, fatal=Fatal(), drain=drain, door=door
    )
    freeze_startup_heap()
    server(app, "127.0.0.1", port).run()


def burst(url: str, count: int) -> list[tuple[int, float]]:
    from burst_client import burst_at_once, request

    return asyncio.run(burst_at_once(url, [request(seed, "64x64", steps=2) for seed in range(count)]))


def _commit(checkout: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bursts", default="500,783", help="refusals per burst, comma-separated")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--versus", type=Path, help="another checkout whose door is measured beside this one's")
    parser.add_argument("--versus-side", default="door", help="what the other checkout serves (--serve SIDE)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return

    import psutil

    sizes = [int(size) for size in args.bursts.split(",")]
    load_before = paired.load()
    scripts = {"door": (Path(__file__), "door")}
    if args.versus is not None:
        scripts["versus"] = (args.versus / "benchmarks" / "door_burst.py", args.versus_side)
    sides = tuple(scripts)
    ports = {side: paired.free_port() for side in sides}
    servers = {
        side: paired.child(
            [sys.executable, str(script), "--serve", serves, "--port", str(ports[side])],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for side, (script, serves) in scripts.items()
    }
    try:
        for side in sides:
            paired.wait_ready(f"http://127.0.0.1:{ports[side]}", servers[side], seconds=120)
        rows: list[dict] = []
        for rep in range(args.reps):
            row: dict = {"load_1m": paired.load()["load_1m"]}
            for size in sizes:
                for side in sides[rep % len(sides) :] + sides[: rep % len(sides)]:
                    process = psutil.Process(servers[side].pid)
                    cpu_before = paired.tree_cpu_seconds(process)
                    answers = burst(f"http://127.0.0.1:{ports[side]}", size)
                    time.sleep(0.3)  # the last closes, counted in the server's CPU
                    cpu = paired.tree_cpu_seconds(process) - cpu_before
                    assert {status for status, _ in answers} == {429}, "every request is refused"
                    latencies = sorted(seconds for _, seconds in answers)
                    row[f"{side} {size}"] = {
                        "max_ms": latencies[-1] * 1000,
                        "p99_ms": latencies[math.ceil(0.99 * len(latencies)) - 1] * 1000,
                        "p50_ms": latencies[len(latencies) // 2] * 1000,
                        "cpu_us_per_refusal": cpu / size * 1e6,
                    }
                    time.sleep(1.5)  # the door's one log line for the burst
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for process in servers.values():
            process.terminate()
            process.wait(30)

    cells = [key for key in rows[0] if key != "load_1m"]
    fields = list(rows[0][cells[0]])
    result = {
        "command": "python benchmarks/door_burst.py " + " ".join(sys.argv[1:]),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": paired.machine(),
        "load_before": load_before,
        "load_after": paired.load(),
        "bursts": sizes,
        "versus": None
        if args.versus is None
        else {"checkout": str(args.versus), "commit": _commit(args.versus), "side": args.versus_side},
        "reps": rows,
        "summary": {
            cell: {field: paired.spread([row[cell][field] for row in rows]) for field in fields} for cell in cells
        },
    }
    if args.versus is not None:
        result["ratio_door_over_versus"] = {
            size: {
                field: paired.spread([row[f"door {size}"][field] / row[f"versus {size}"][field] for row in rows])
                for field in fields
            }
            for size in sizes
        }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=1))
    if args.versus is not None:
        print(json.dumps(result["ratio_door_over_versus"], indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
