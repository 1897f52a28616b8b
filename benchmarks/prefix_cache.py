"""Prefix caching with hidden-state reconstruction: the A / B1 / B2 protocol, on the real engine.

- A:  prefix caching off.
- B1: caching on, the cache reset before every sample (each sample must show cached_tokens = 0).
- B2: caching on and warmed (each sample must show cached_tokens = (P - 1) // B * B).
A sample whose cache counts do not match its scenario is rejected, and the run fails.

Workloads: a long shared-prefix prompt (~5,600 tokens) and a short one (~600), each with a short
generation. Capture overhead: scenario A again with hidden-state capture off. Every engine runs
in this process one after another, on the same machine, in the same run.

TTFT here is engine submission → first generated token (the service adds HTTP parsing and
templating in front of it). Reported: TTFT p50/p95/mean, end-to-end, prefill and decode tokens/s,
peak RSS of this process and its engine processes, and ratios.

    python benchmarks/prefix_cache.py [--samples 10] [--long 5600] [--short 600] [--new-tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import platform
import statistics
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from ar_service import ArSettings, EngineRequest, FinishedEvent, HiddenStateEngine

RESULTS = Path(__file__).parent / "results"


@dataclass
class Sample:
    ttft: float
    e2e: float
    prompt_tokens: int
    generated: int
    cached: int
    rows: int


class PeakRss:
    """Peak resident memory of this process and all its children, sampled every 100 ms."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(0.1):
            try:
                total = me.memory_info().rss + sum(c.memory_info().rss for c in me.children(recursive=True))
            except psutil.Error:
                continue
            self.peak = max(self.peak, total)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def workload(length: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


async def one(engine: HiddenStateEngine, prompt: list[int], new_tokens: int, salt: str) -> Sample:
    finished: FinishedEvent | None = None
    request = EngineRequest(
        engine_request_id=f"bench:{uuid.uuid4().hex[:10]}",
        prompt_token_ids=prompt,
        max_new_tokens=new_tokens,
        cache_salt=salt,
    )
    async for event in engine.run(request):
        if isinstance(event, FinishedEvent):
            finished = event
    assert finished is not None
    return Sample(
        ttft=finished.first_token_at - finished.submitted_at,
        e2e=finished.finished_at - finished.submitted_at,
        prompt_tokens=finished.prompt_tokens,
        generated=len(finished.generated_token_ids),
        cached=finished.cached_tokens,
        rows=finished.row_count,
    )


async def scenario(engine: HiddenStateEngine, name: str, prompt: list[int], samples: int, new_tokens: int) -> dict:
    block = engine.block_size
    expected = {"A": 0, "B1": 0, "B2": (len(prompt) - 1) // block * block}[name]
    salt = f"bench-{name}-{len(prompt)}"
    runs: list[Sample] = []
    for i in range(samples + 1):  # sample 0 is the warm-up (and, for B2, fills the cache)
        if name == "B1":
            assert await engine.reset_prefix_cache(), "prefix cache reset refused"
        sample = await one(engine, prompt, new_tokens, salt)
        if i == 0:
            continue
        if sample.cached != expected:
            raise RuntimeError(
                f"{name} P={len(prompt)}: sample {i} has cached_tokens={sample.cached}, expected {expected}"
            )
        if engine.settings.capture_hidden_states and sample.rows != len(prompt) + sample.generated - 1:
            raise RuntimeError(f"{name}: {sample.rows} rows for P={len(prompt)}, G={sample.generated}")
        runs.append(sample)
    ttfts = sorted(s.ttft for s in runs)
    return {
        "scenario": name,
        "prompt_tokens": len(prompt),
        "block_size": block,
        "expected_cached_tokens": expected,
        "samples": len(runs),
        "ttft_ms": {
            "p50": statistics.median(ttfts) * 1e3,
            "p95": ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))] * 1e3,
            "mean": statistics.fmean(ttfts) * 1e3,
        },
        "e2e_ms_mean": statistics.fmean(s.e2e for s in runs) * 1e3,
        "prefill_tokens_per_s": statistics.fmean(s.prompt_tokens / s.ttft for s in runs),
        "decode_tokens_per_s": statistics.fmean((s.generated - 1) / max(s.e2e - s.ttft, 1e-9) for s in runs),
    }


def run_engine(
    settings: ArSettings, plan: list[tuple[str, list[int]]], samples: int, new_tokens: int
) -> tuple[list[dict], int]:
    rss = PeakRss()
    engine = HiddenStateEngine(settings)
    engine.start()

    async def all_scenarios() -> list[dict]:
        return [await scenario(engine, name, prompt, samples, new_tokens) for name, prompt in plan]

    try:
        results = asyncio.run(all_scenarios())
    finally:
        engine.shutdown()
    return results, rss.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--long", type=int, default=5600)
    parser.add_argument("--short", type=int, default=600)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS / "prefix_cache.json")
    args = parser.parse_args()

    prompts = {"long": workload(args.long, 1), "short": workload(args.short, 2)}
    engine_settings = functools.partial(
        ArSettings, kv_cache_bytes=1 << 30, max_model_len=8192, max_num_batched_tokens=2048
    )
    started = time.time()
    configs = {
        "caching_on_capture_on": (
            engine_settings(enable_prefix_caching=True),
            [(s, p) for p in prompts.values() for s in ("B1", "B2")],
        ),
        "caching_off_capture_on": (
            engine_settings(enable_prefix_caching=False),
            [("A", p) for p in prompts.values()],
        ),
        "caching_off_capture_off": (
            engine_settings(enable_prefix_caching=False, capture_hidden_states=False),
            [("A", p) for p in prompts.values()],
        ),
    }
    report: dict = {
        "command": "python benchmarks/prefix_cache.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out")
        + f" --out {args.out}",
        "machine": {
            "node": platform.platform(),
            "cpu": platform.processor() or platform.machine(),
            "cores": psutil.cpu_count(),
            "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "torch": torch.__version__,
            "model": ArSettings().model_dir.name,
            "dtype": "float32",
        },
        "engines": {},
    }
    for name, (settings, plan) in configs.items():
        results, peak = run_engine(settings, plan, args.samples, args.new_tokens)
        report["engines"][name] = {"peak_rss_mb": round(peak / 2**20), "scenarios": results}
        print(json.dumps({name: report["engines"][name]}, indent=1), flush=True)

    def ttft(engine: str, scenario_name: str, length: int) -> float:
        for r in report["engines"][engine]["scenarios"]:
            if r["scenario"] == scenario_name and r["prompt_tokens"] == length:
                return r["ttft_ms"]["mean"]
        raise KeyError((engine, scenario_name, length))

    report["ratios"] = {
        f"{label}_B2_ttft_reduction_vs_B1": 1
        - ttft("caching_on_capture_on", "B2", n) / ttft("caching_on_capture_on", "B1", n)
        for label, n in (("long", args.long), ("short", args.short))
    } | {
        f"{label}_capture_ttft_overhead_in_A": ttft("caching_off_capture_on", "A", n)
        / ttft("caching_off_capture_off", "A", n)
        - 1
        for label, n in (("long", args.long), ("short", args.short))
    }
    report["targets"] = {
        "long B2 TTFT >= 80% lower than B1": report["ratios"]["long_B2_ttft_reduction_vs_B1"] >= 0.8,
        "capture overhead on TTFT <= 10% in A (long)": report["ratios"]["long_capture_ttft_overhead_in_A"] <= 0.10,
    }
    report["wall_seconds"] = round(time.time() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"ratios": report["ratios"], "targets": report["targets"]}, indent=2))


if __name__ == "__main__":
    main()
