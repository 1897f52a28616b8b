"""Capture's decode cost: decode with hidden-state capture vs without, side by side, on warm contexts.

Three engines live in this process at once (each pinned to all cores, prefix caching on), and every
round sends the same requests to each, in rotating order, so the machine's load hits all alike:

- ``with_draft``: capture as vLLM's ``extract_hidden_states`` ships it: each decode step also runs
  a duplicate "draft" token (``capture_without_draft=False``) — the old behaviour;
- ``without_draft``: capture as ardit runs it (``ar_service/engine/draft_free.py``);
- ``capture_off``: no capture — the target.

Per round and engine: a warm request on the long prompt (``(P-1)//B*B`` tokens cached, checked)
and on the short one, each generating ``--new-tokens``: decode tokens/s (first to last token), TTFT,
and the CPU seconds of the engine processes and this process for the request (CPU time is what the
request cost; wall time also carries the machine's other load). Then a cold short prompt (a fresh
cache salt: a verified miss) for capture's TTFT overhead. Ratios are per round: median, p10-p90.

``--profile`` then samples each engine's core process, where its model runs, with py-spy
(``worker_profile.py``) during a long decode and attributes its time per generated token (attention
kernel, linear layers, sampler, rejection sampler, row write, row read and send, time between steps).

    python benchmarks/capture_decode.py [--rounds 8] [--long 5600] [--short 600] [--new-tokens 32] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paired
import psutil

paired.use_this_checkout()

import bench_engines  # noqa: E402
from worker_profile import WorkerProfile  # noqa: E402

from ar_service import (  # noqa: E402
    ArSettings,
    EngineRequest,
    FinishedEvent,
    HiddenStateEngine,
)

ENGINES: dict[str, dict[str, Any]] = {
    "with_draft": {"capture_hidden_states": True, "capture_without_draft": False},
    "without_draft": {"capture_hidden_states": True, "capture_without_draft": True},
    "capture_off": {"capture_hidden_states": False},
}


@dataclass
class Engine:
    name: str
    engine: HiddenStateEngine
    core: psutil.Process  # the EngineCore process, which runs the model (the AR keeps vLLM's executor in it)


@dataclass
class Sample:
    ttft: float
    decode_tokens_per_s: float
    cpu_seconds: float
    generated: int


def start(name: str) -> Engine:
    engine, core = bench_engines.start_engine(name, ENGINES[name])
    return Engine(name, engine, core)


async def request(engine: Engine, prompt: list[int], new_tokens: int, salt: str, expected_cached: int) -> Sample:
    me = psutil.Process()
    cpu_before = paired.tree_cpu_seconds(engine.core) + sum(me.cpu_times()[:2])
    finished: FinishedEvent | None = None
    run = EngineRequest(
        engine_request_id=f"bench:{uuid.uuid4().hex[:10]}",
        prompt_token_ids=prompt,
        max_new_tokens=new_tokens,
        cache_salt=salt,
    )
    async for event in engine.engine.run(run):
        if isinstance(event, FinishedEvent):
            finished = event
    cpu = paired.tree_cpu_seconds(engine.core) + sum(me.cpu_times()[:2]) - cpu_before
    assert finished is not None
    if finished.cached_tokens != expected_cached:
        raise RuntimeError(f"{engine.name}: cached_tokens {finished.cached_tokens}, expected {expected_cached}")
    generated = len(finished.generated_token_ids)
    if engine.engine.settings.capture_hidden_states and finished.row_count != len(prompt) + generated - 1:
        raise RuntimeError(f"{engine.name}: {finished.row_count} rows for P={len(prompt)}, G={generated}")
    decode = finished.finished_at - finished.first_token_at
    return Sample(
        ttft=finished.first_token_at - finished.submitted_at,
        decode_tokens_per_s=(generated - 1) / decode if generated > 1 else float("nan"),
        cpu_seconds=cpu,
        generated=generated,
    )


async def profile(engine: Engine, prompt: list[int], new_tokens: int, salt: str) -> dict:
    """The engine core's time per generated token over one warm long request (its short tail prefill included)."""
    spy = WorkerProfile(engine.core.pid)
    await asyncio.sleep(0.3)  # py-spy attaches
    cached = (len(prompt) - 1) // engine.engine.block_size * engine.engine.block_size
    sample = await request(engine, prompt, new_tokens, salt, cached)
    return spy.stop(units=sample.generated - 1) | {"decode_tokens_per_s": round(sample.decode_tokens_per_s, 2)}


async def measure(args: argparse.Namespace, engines: list[Engine], prompts: dict[str, list[int]]) -> dict:
    block = engines[0].engine.block_size
    warm_cached = {name: (len(p) - 1) // block * block for name, p in prompts.items()}
    warm_salt = "capture-decode"
    for engine in engines:  # cold fill of both prompts: every later request on them is a verified hit
        for prompt in prompts.values():
            await request(engine, prompt, 1, warm_salt, 0)
    samples: dict[str, dict[str, list[Sample]]] = {e.name: collections.defaultdict(list) for e in engines}
    loads = []
    for round_ in range(args.rounds):
        order = engines[round_ % len(engines) :] + engines[: round_ % len(engines)]
        loads.append(paired.load()["load_1m"])
        for engine in order:
            for name, prompt in prompts.items():
                sample = await request(engine, prompt, args.new_tokens, warm_salt, warm_cached[name])
                samples[engine.name][f"{name}_warm"].append(sample)
            cold = await request(engine, prompts["short"], 1, f"cold-{round_}-{uuid.uuid4().hex[:6]}", 0)
            samples[engine.name]["short_cold"].append(cold)
        print(f"round {round_ + 1}/{args.rounds} done, load {loads[-1]}", flush=True)
    report: dict = {"block_size": block, "cached_tokens": warm_cached, "load_1m_per_round": loads, "engines": {}}
    for engine in engines:
        report["engines"][engine.name] = {
            workload: {
                "ttft_ms": paired.spread([s.ttft * 1e3 for s in runs]),
                "decode_tokens_per_s": paired.spread([s.decode_tokens_per_s for s in runs]),
                "cpu_seconds": paired.spread([s.cpu_seconds for s in runs]),
            }
            for workload, runs in samples[engine.name].items()
        }
    ratios: dict = {}
    for side in ("with_draft", "without_draft"):
        for workload in ("long_warm", "short_warm"):
            mine, base = samples[side][workload], samples["capture_off"][workload]
            ratios[f"{side}/capture_off {workload} decode tokens/s"] = paired.spread(
                [a.decode_tokens_per_s / b.decode_tokens_per_s for a, b in zip(mine, base, strict=True)]
            )
            ratios[f"{side}/capture_off {workload} CPU seconds"] = paired.spread(
                [a.cpu_seconds / b.cpu_seconds for a, b in zip(mine, base, strict=True)]
            )
        for workload in ("long_warm", "short_warm", "short_cold"):
            mine, base = samples[side][workload], samples["capture_off"][workload]
            ratios[f"{side}/capture_off {workload} TTFT"] = paired.spread(
                [a.ttft / b.ttft for a, b in zip(mine, base, strict=True)]
            )
    for workload in ("long_warm", "short_warm"):
        mine, base = samples["without_draft"][workload], samples["with_draft"][workload]
        ratios[f"without_draft/with_draft {workload} decode tokens/s"] = paired.spread(
            [a.decode_tokens_per_s / b.decode_tokens_per_s for a, b in zip(mine, base, strict=True)]
        )
    report["ratios"] = ratios
    if args.profile:
        report["profile_ms_per_token"] = {
            engine.name: await profile(engine, prompts["long"], args.new_tokens, warm_salt) for engine in engines
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--long", type=int, default=5600)
    parser.add_argument("--short", type=int, default=600)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--profile", action="store_true", help="py-spy each engine's core during a long decode")
    parser.add_argument("--out", type=Path, default=paired.RESULTS / "capture_decode.json")
    args = parser.parse_args()
    report: dict = {
        "command": "python benchmarks/capture_decode.py "
        + f"--rounds {args.rounds} --long {args.long} --short {args.short} --new-tokens {args.new_tokens}"
        + (" --profile" if args.profile else ""),
        "machine": paired.machine() | {"model": ArSettings().model_dir.name, "dtype": "float32"},
        "load_before": paired.load(),
    }
    started = time.time()
    engines: list[Engine] = []
    try:
        for name in ENGINES:
            engines.append(start(name))
        prompts = {"long": bench_engines.workload(args.long, 1), "short": bench_engines.workload(args.short, 2)}
        report |= asyncio.run(measure(args, engines, prompts))
        report["peak_rss_mb_all_engines"] = round(paired.tree_rss(psutil.Process()) / 2**20)
    finally:
        for engine in engines:
            engine.engine.shutdown()
    report["load_after"] = paired.load()
    report["wall_seconds"] = round(time.time() - started)
    long_ratio = report["ratios"]["without_draft/capture_off long_warm decode tokens/s"]["p50"]
    report["targets"] = {"decode with capture within 5% of without (long, median)": long_ratio >= 0.95}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"ratios": report["ratios"], "targets": report["targets"]}, indent=1))


if __name__ == "__main__":
    main()
