"""ardit against vLLM-Omni, the whole table in one command: ``peer_compare.py --peer vllm-omni`` for every
size x dtype, on a quiet machine and again with cores kept busy (``--background-load``), both systems
serving the same Qwen-Image folder at the same dtype without CFG, side by side and alternating.

    benchmarks/vllm_omni/setup.sh            # vLLM-Omni's own venv, once
    python benchmarks/vllm_omni_table.py [--repeats 3] [--requests 8] [--steps 20]

Each combination's full report (cells, ratios with p10-p90, CPU-seconds per image, peak RSS, each also process by
process, load) goes under ``runs`` in the output; the tables printed at the end are what ``results/vllm_omni.md``
shows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import paired

MODEL = Path("~/.cache/ardit/models/qwen-image-full-tiny")


def run(args: argparse.Namespace, size: str, dtype: str, load: int, out: Path) -> dict:
    command = [
        sys.executable,
        str(Path(__file__).with_name("peer_compare.py")),
        "--peer",
        "vllm-omni",
        "--model",
        str(args.model),
        "--dtype",
        dtype,
        "--size",
        size,
        "--steps",
        str(args.steps),
        "--requests",
        str(args.requests),
        "--repeats",
        str(args.repeats),
        "--concurrency",
        args.concurrency,
        "--background-load",
        str(load),
        "--out",
        str(out),
    ]
    subprocess.run(command, check=True, cwd=paired.REPO, stdout=subprocess.DEVNULL)
    report: dict = json.loads(out.read_text())
    return report


def ratio(spread: dict) -> str:
    return f"{spread['p50']:.2f} ({spread['p10']:.2f}-{spread['p90']:.2f})"


def p99(result: dict) -> str:
    """The p99 latency ratio per repeat; a run from before peer_compare.py paired it gives its medians' ratio."""
    if "ardit/peer latency_p99" in result:
        return ratio(result["ardit/peer latency_p99"])
    return f"{result['ardit']['latency_p99_s']['p50'] / result['peer']['latency_p99_s']['p50']:.2f} (of medians)"


def table(runs: dict) -> str:
    lines = [
        "| machine | dtype | size | cell | ardit img/min | vLLM-Omni img/min | ardit / vLLM-Omni img/min "
        "| p50 latency ratio | p99 latency ratio | CPU-s / image ratio | 429s ardit, vLLM-Omni |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, report in runs.items():
        size, dtype, load = name.split()
        machine = "quiet" if load == "load=0" else f"{load.split('=')[1]} core(s) busy"
        for cell, result in report["cells"].items():
            lines.append(
                f"| {machine} | {dtype} | {size} | {cell} | {result['ardit']['images_per_min']['p50']:.0f} "
                f"| {result['peer']['images_per_min']['p50']:.0f} | {ratio(result['ardit/peer images_per_min'])} "
                f"| {ratio(result['ardit/peer latency_p50'])} | {p99(result)} "
                f"| {ratio(result['ardit/peer cpu_seconds_per_image'])} "
                f"| {result['ardit']['refused_429']}, {result['peer']['refused_429']} |"
            )
        for key, label in (("peak_rss_mb", "peak RSS from launch"), ("serving_peak_rss_mb", "peak RSS once ready")):
            rss = report[key]
            lines.append(
                f"| {machine} | {dtype} | {size} | {label} | {rss['ardit']:,} MB | {rss['peer']:,} MB "
                f"| {rss['ardit'] / rss['peer']:.2f}x | | | | |"
            )
    return "\n".join(lines)


def processes(runs: dict) -> str:
    """Where each system's CPU and memory go, process by process: CPU-seconds per image at concurrency 1 (medians
    over repeats) and each process's RSS at the peak of the tree's sum, from launch and once ready."""
    lines = [
        "| machine | dtype | size | system | process | CPU-s / image, unique c=1 | CPU-s / image, shared c=1 "
        "| RSS at the peak from launch, MB | RSS at the peak once ready, MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, report in runs.items():
        size, dtype, load = name.split()
        machine = "quiet" if load == "load=0" else f"{load.split('=')[1]} core(s) busy"
        for system, label in (("ardit", "ardit"), ("peer", "vLLM-Omni")):
            unique = report["cells"]["unique c=1"][system]["cpu_seconds_per_image_by_process"]
            shared = report["cells"]["shared_prefix c=1"][system]["cpu_seconds_per_image_by_process"]
            rss, serving = report["peak_rss_mb_by_process"][system], report["serving_peak_rss_mb_by_process"][system]
            for process in sorted(set(unique) | set(rss), key=lambda p: -unique.get(p, 0.0)):
                lines.append(
                    f"| {machine} | {dtype} | {size} | {label} | {process} | {unique.get(process, 0.0):.3f} "
                    f"| {shared.get(process, 0.0):.3f} | {rss.get(process, 0):,} | {serving.get(process, 0):,} |"
                )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--sizes", default="64x64,256x256")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--loads", default="0,1", help="cores kept busy, one run each")
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=paired.RESULTS / "vllm_omni.json")
    args = parser.parse_args()
    started = time.time()
    runs: dict = {}
    with tempfile.TemporaryDirectory() as scratch:
        for load in (int(x) for x in args.loads.split(",")):
            for dtype in args.dtypes.split(","):
                for size in args.sizes.split(","):
                    name = f"{size} {dtype} load={load}"
                    print(f"{time.strftime('%H:%M:%S')} {name}", flush=True)
                    runs[name] = run(args, size, dtype, load, Path(scratch) / "run.json")
                    report = {  # written after every run: a table cut short keeps what it measured
                        "command": "python benchmarks/vllm_omni_table.py " + " ".join(sys.argv[1:]),
                        "machine": paired.machine(),
                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
                        "wall_seconds": round(time.time() - started),
                        "runs": runs,
                    }
                    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(runs))
    print(processes(runs))


if __name__ == "__main__":
    main()
