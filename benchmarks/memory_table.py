"""Where ardit's memory goes at ``make run``'s defaults, process by process.

Starts the pair as ``make run`` does (``python -m services.launcher``, on free ports, with whatever
``ARDIT_*`` settings the environment holds), serves ``--requests`` images at ``--concurrency``, then
reads each process of the tree: RSS (what "peak RSS" sums), PSS (shared library pages split between
the processes that map them) and USS (pages only it holds). The largest mappings of the process
that holds the AR's model are listed one by one (its heap holds the weights, an anonymous mapping the
KV cache), so a change in one of them shows: vLLM's engine core (runs before 2026-12-04 had a vLLM
worker process for the model). The peak of the tree's summed RSS is sampled every 0.25 s from launch, as
``peer_compare.py`` does, and reported for start-up and serving apart (labels before
``released_once_ready_run1`` sampled serving only). Each process's RSS is also split into anonymous
pages (its own: heap, weights read into memory, KV cache) and file pages (shared libraries, and
weights a process maps from their file instead of reading them), from ``/proc/PID/status``.

``--peer`` measures ``peer_server.py`` (what ``peer_compare.py`` compares against) the same way.

    python benchmarks/memory_table.py --label sized_kv [--requests 24] [--concurrency 8] [--size 64x64]
        [--steps 20] [--peer]
    ARDIT_AR_KV_CACHE_BYTES=536870912 ARDIT_AR_MAX_MODEL_LEN=8192 python benchmarks/memory_table.py --label fixed_kv

Each run is added under its label to ``--out`` (benchmarks/results/memory_table.json).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import paired
import psutil

MAPPINGS_LISTED = 6


def largest_mappings(pid: int) -> list[dict]:
    """The process's largest resident mappings: heap, anonymous regions and files, in MB."""
    mappings: list[dict] = []
    current: dict | None = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            current = {"mapping": fields[5] if len(fields) > 5 else "[anonymous]", "rss_mb": 0.0}
            mappings.append(current)
        elif fields[0] == "Rss:" and current is not None:
            current["rss_mb"] = round(int(fields[1]) / 1024, 1)
    mappings.sort(key=lambda m: -m["rss_mb"])
    return mappings[:MAPPINGS_LISTED]


def rss_parts(pid: int) -> dict[str, int]:
    """The process's resident memory split: anonymous pages and file pages, in MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {f"rss_{kind}_mb": int(fields[f"Rss{kind.title()}"].split()[0]) // 1024 for kind in ("anon", "file")}


def serve(url: str, requests: int, concurrency: int, extra: dict[str, object]) -> float:
    def one(index: int) -> None:
        body = {"prompt": f"a red circle number {index} in the top left", "seed": index, **extra}
        response = httpx.post(f"{url}/v1/images/generations", json=body, timeout=600)
        response.raise_for_status()

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(requests)))
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", type=Path, default=paired.RESULTS / "memory_table.json")
    parser.add_argument("--peer", action="store_true", help="measure peer_server.py instead of ardit")
    parser.add_argument("--size", help="each request's size (default: the server's)")
    parser.add_argument("--steps", type=int, help="each request's num_inference_steps (default: the server's)")
    args = parser.parse_args()

    port = paired.free_port()
    if args.peer:
        command = [sys.executable, str(Path(__file__).with_name("peer_server.py")), "--port", str(port)]
        env = dict(os.environ)
    else:
        command = [sys.executable, "-m", "services.launcher"]
        env = os.environ | {"ARDIT_AR_PORT": str(port), "ARDIT_DIT_PORT": str(paired.free_port())}
        env |= {"ARDIT_AR_LOG_LEVEL": "WARNING"}
    launcher = paired.child(command, env=env, cwd=paired.REPO)
    root, url = psutil.Process(launcher.pid), f"http://127.0.0.1:{port}"
    # The peak while starting and the peak while serving, apart: start-up's can be the larger.
    peaks, phase, done = {"starting": 0, "serving": 0}, "starting", threading.Event()

    def sample() -> None:
        while not done.wait(0.25):
            try:
                peaks[phase] = max(peaks[phase], paired.tree_rss(root))
            except psutil.Error:
                continue

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        paired.wait_ready(url, launcher)
        phase = "serving"
        extra = {"size": args.size} if args.size else {}
        extra |= {"num_inference_steps": args.steps} if args.steps else {}
        seconds = serve(url, args.requests, args.concurrency, extra)
        processes = []
        for process in [root, *root.children(recursive=True)]:
            memory = process.memory_full_info()
            row = {
                "process": paired.role(process),
                "rss_mb": round(memory.rss / 2**20),
                "pss_mb": round(memory.pss / 2**20),
                "uss_mb": round(memory.uss / 2**20),
                **rss_parts(process.pid),
                "threads": process.num_threads(),
            }
            if "KV cache" in row["process"] or args.peer:
                row["largest_mappings"] = largest_mappings(process.pid)
            processes.append(row)
    finally:
        done.set()
        launcher.send_signal(2)
        try:
            launcher.wait(120)
        except subprocess.TimeoutExpired:
            launcher.kill()
    settings = {k: v for k, v in os.environ.items() if k.startswith("ARDIT_")}
    run = {
        "command": " ".join([*(f"{k}={v}" for k, v in settings.items()), "python", *sys.argv]),
        "machine": paired.machine(),
        "load": paired.load(),
        "served": {"requests": args.requests, "concurrency": args.concurrency, **extra, "seconds": round(seconds, 1)},
        "peak_tree_rss_mb": round(max(peaks.values()) / 2**20),
        "peak_tree_rss_mb_starting": round(peaks["starting"] / 2**20),
        "peak_tree_rss_mb_serving": round(peaks["serving"] / 2**20),
        "after_serving": {
            "processes": processes,
            "total_rss_mb": sum(p["rss_mb"] for p in processes),
            "total_pss_mb": sum(p["pss_mb"] for p in processes),
        },
    }
    report = json.loads(args.out.read_text()) if args.out.exists() else {}
    report[args.label] = run
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        json.dumps(run["after_serving"], indent=2),
        f"\npeak tree RSS {run['peak_tree_rss_mb']} MB",
        f"(starting {run['peak_tree_rss_mb_starting']}, serving {run['peak_tree_rss_mb_serving']})",
    )


if __name__ == "__main__":
    main()
