"""A burst of refusals: the AR's admission door in uvicorn's HTTP protocol against the same door as the
app's outermost ASGI layer (where it was before 2026-12-04), side by side.

Two servers run as the AR's public port runs (``services.serve.server``, uvicorn's httptools protocol,
the services' logging), each in front of the same small app, each with its line full so that every
request is refused: ``protocol`` is ``ar_service.api.admission_door.AdmissionDoor`` as the AR installs
it; ``asgi`` answers the same refusal (the same decision, body, request id and counters) from a pure
ASGI layer outside the app's middleware, through uvicorn's request cycle, task and access log. Each
repetition sends ``--burst`` requests at once to each (rotating order) with the client
``tests/e2e/test_load.py`` uses, and records each refusal's latency (request written → status line
read) and the server's CPU time per refusal; ratios are protocol / asgi per repetition.

``--versus DIR`` adds a third server in the same rotation: the door of another checkout of this repository
(its own ``benchmarks/door_burst.py --serve protocol``, a ``git worktree`` of an older commit, say), and
the ratios protocol / versus.

    python benchmarks/door_burst.py [--burst 522] [--reps 10] [--versus DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import paired

paired.use_this_checkout()

RESULTS = paired.RESULTS / "door_burst.json"
SIDES = ("protocol", "asgi")


def serve(side: str, port: int) -> None:
    """One side's server, its line full, until it is stopped."""
    from prometheus_client import CollectorRegistry
    from starlette.types import ASGIApp, Receive, Scope, Send

    from ar_service.admission import RequestAdmission
    from ar_service.api.admission_door import AdmissionDoor
    from ar_service.metrics import ArMetrics
    from services.app import Readiness, create_app
    from services.auth import BearerAuth
    from services.drain import Drain
    from services.errors import ApiError
    from services.fatal import Fatal
    from services.heap import freeze_startup_heap
    from services.request_context import REQUEST_ID_HEADER, configure_logging, request_id_of
    from services.serve import server

    configure_logging("ar")

    class Full:
        """The pair's readiness as the door sees it: known, with no slot (every request refused)."""

        def known_capacity(self) -> int:
            return 0

    metrics = ArMetrics(CollectorRegistry())
    drain = Drain(10.0)
    door = AdmissionDoor(
        admission=RequestAdmission(0, 120.0, metrics),
        readiness=Full(),  # type: ignore[arg-type]
        paths=["/v1/images/generations"],
        auth=BearerAuth([], what="API key", missing_code="missing_api_key", invalid_code="invalid_api_key"),
        drain=drain,
        metrics=metrics.app,
        internal_port=None,
    )

    class AsgiDoor:
        """The same refusal from the app's outermost ASGI layer."""

        def __init__(self, app: ASGIApp) -> None:
            self.app = app

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            entered = door.enter(scope) if scope["type"] == "http" else None
            if not isinstance(entered, ApiError):
                await self.app(scope, receive, send)
                return
            entered.headers[REQUEST_ID_HEADER] = request_id_of(scope)
            metrics.app.count_error(entered)
            await entered.response()(scope, receive, send)
            metrics.app.observe_response(scope["path"], scope["method"], str(entered.status), 0.0)

    async def ready() -> Readiness:
        return Readiness(True, "ready")

    app = create_app(
        "door_burst",
        lifespan=None,
        readiness=ready,
        app_metrics=metrics.app,
        fatal=Fatal(),
        drain=drain,
        door=door if side == "protocol" else None,
    )
    if side == "asgi":
        app.add_middleware(AsgiDoor)
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
    parser.add_argument("--burst", type=int, default=522, help="refusals per burst (test_load's at 783 sent)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--versus", type=Path, help="another checkout whose door is measured beside this one's")
    parser.add_argument("--serve", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return

    import psutil

    load_before = paired.load()
    scripts = {side: (Path(__file__), side) for side in SIDES}
    if args.versus is not None:
        scripts["versus"] = (args.versus / "benchmarks" / "door_burst.py", "protocol")
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
            row: dict = {}
            for side in sides[rep % len(sides) :] + sides[: rep % len(sides)]:
                process = psutil.Process(servers[side].pid)
                cpu_before = paired.tree_cpu_seconds(process)
                answers = burst(f"http://127.0.0.1:{ports[side]}", args.burst)
                time.sleep(0.3)  # the last closes, counted in the server's CPU
                cpu = paired.tree_cpu_seconds(process) - cpu_before
                assert {status for status, _ in answers} == {429}, "every request is refused"
                latencies = sorted(seconds for _, seconds in answers)
                row[side] = {
                    "max_ms": latencies[-1] * 1000,
                    "p50_ms": latencies[len(latencies) // 2] * 1000,
                    "cpu_us_per_refusal": cpu / args.burst * 1e6,
                }
            rows.append(row)
            print(json.dumps(row), flush=True)
            time.sleep(1.5)  # the door's one log line for the burst
    finally:
        for process in servers.values():
            process.terminate()
            process.wait(30)

    def ratio(field: str, over: str) -> dict[str, float]:
        return paired.spread([row["protocol"][field] / row[over][field] for row in rows])

    fields = list(rows[0]["protocol"])
    result = {
        "command": "python benchmarks/door_burst.py " + " ".join(sys.argv[1:]),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": paired.machine(),
        "load_before": load_before,
        "load_after": paired.load(),
        "burst": args.burst,
        "versus": None if args.versus is None else {"checkout": str(args.versus), "commit": _commit(args.versus)},
        "reps": rows,
        "summary": {
            side: {field: paired.spread([row[side][field] for row in rows]) for field in fields} for side in sides
        },
        **{f"ratio_protocol_over_{over}": {field: ratio(field, over) for field in fields} for over in sides[1:]},
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=1))
    for over in sides[1:]:
        print(over, json.dumps(result[f"ratio_protocol_over_{over}"], indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
