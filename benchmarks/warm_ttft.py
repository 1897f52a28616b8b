"""Warm TTFT vs the uncached tail: what a prefix-cache hit still costs, and why.

B2: a long prompt whose first ``(P-1)//B*B`` tokens are cached (checked). Its only uncached part is
the tail. The same run also measures the tail alone as a prompt of its own, on a cold cache (a fresh
cache salt: a verified miss). Both on two engines side by side, capture on (as ardit runs) and capture
off, in rotating order, ``--rounds`` times; ratios are per round (median, p10-p90).

The B2 time is attributed from four sources:

- vLLM's own per-request engine timestamps (``RequestOutput.metrics``: queued, scheduled, first
  token, on the same monotonic clock as this process): submit -> queued (input processing, IPC, the
  engine core hashing the prompt's blocks), queued -> scheduled (the scheduler, its prefix lookup
  included), scheduled -> first token in the engine core (the step: tail prefill over the whole
  context, sampling, the connector reading every prompt row back), engine core -> this process;
- the capture engine minus the capture-off engine: what reading the rows back adds to TTFT;
- py-spy on the capture engine's core process, where its model runs (``worker_profile.py``), over
  ``--profile-requests`` B2 requests and as many tail-only ones: its shares of in-step samples
  (attention kernel, linear layers, connector...) split the median engine step into parts
  (``step_attribution_ms``);
- the row read-back on its own (``rows_readback``): the connector's gather of P rows from a paged
  cache, the final norm, and the ZMQ hop into the AR process, with the service's own classes.

    python benchmarks/warm_ttft.py [--rounds 10] [--long 5600] [--profile-requests 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paired
import psutil
import torch

paired.use_this_checkout()

import bench_engines  # noqa: E402
from worker_profile import BETWEEN_STEPS, WorkerProfile  # noqa: E402

from ar_service import (  # noqa: E402
    ArSettings,
    EngineRequest,
    FinalNorm,
    FinishedEvent,
    HiddenStateEngine,
    RowChannel,
    RowSender,
    RowsEvent,
)

ENGINES: dict[str, dict[str, Any]] = {
    "capture_on": {"capture_hidden_states": True},
    "capture_off": {"capture_hidden_states": False},
}


class EngineClock:
    """vLLM's per-request stats (engine-core timestamps), tapped from ``AsyncLLM.generate``."""

    def __init__(self, engine: HiddenStateEngine) -> None:
        self.stats: dict[str, object] = {}
        llm = engine.vllm
        generate = llm.generate

        async def tapped(prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any) -> Any:
            async for output in generate(prompt, sampling_params, request_id, **kwargs):
                if output.metrics is not None:
                    self.stats[request_id] = output.metrics
                yield output

        llm.generate = tapped  # type: ignore[method-assign]


@dataclass
class Engine:
    name: str
    engine: HiddenStateEngine
    core: psutil.Process
    clock: EngineClock


@dataclass
class Sample:
    ttft: float
    stages: dict[str, float]  # seconds


def start(name: str) -> Engine:
    engine, core = bench_engines.start_engine(name, ENGINES[name])
    return Engine(name, engine, core, EngineClock(engine))


async def request(engine: Engine, prompt: list[int], salt: str, expected_cached: int) -> Sample:
    run = EngineRequest(
        engine_request_id=f"bench:{uuid.uuid4().hex[:10]}", prompt_token_ids=prompt, max_new_tokens=1, cache_salt=salt
    )
    finished: FinishedEvent | None = None
    rows_at = None
    async for event in engine.engine.run(run):
        if isinstance(event, RowsEvent) and rows_at is None:
            rows_at = time.perf_counter()
        if isinstance(event, FinishedEvent):
            finished = event
    assert finished is not None
    if finished.cached_tokens != expected_cached:
        raise RuntimeError(f"{engine.name}: cached_tokens {finished.cached_tokens}, expected {expected_cached}")
    stats = engine.clock.stats.pop(run.engine_request_id)
    submitted, first = finished.submitted_at, finished.first_token_at
    queued, scheduled, engine_first = stats.queued_ts, stats.scheduled_ts, stats.first_token_ts  # type: ignore[attr-defined]
    if not submitted <= queued <= scheduled <= engine_first <= first:
        raise RuntimeError(f"engine timestamps not on this process's clock: {submitted, queued, scheduled, first}")
    stages = {
        "submit -> queued in the engine core (input processing, IPC, block hashing)": queued - submitted,
        "queued -> scheduled (scheduler, prefix lookup)": scheduled - queued,
        "scheduled -> first token in the engine core (the step)": engine_first - scheduled,
        "engine core -> this process (output IPC, processing)": first - engine_first,
    }
    if rows_at is not None:
        stages["prompt rows in this process, from submit"] = rows_at - submitted
    return Sample(ttft=first - submitted, stages=stages)


async def rows_readback(rows: int, hidden: int, block: int, model_dir: Path, reps: int) -> dict:
    """The connector's read of ``rows`` cached rows (gather, final norm, ZMQ hop), as its code does it."""
    blocks = rows // block + 1
    kv = torch.randn(blocks + 8, 1, block, hidden)  # [blocks, captured layers, block, hidden], like vLLM's
    table = torch.randperm(blocks + 8)[:blocks].tolist()
    slots = torch.tensor([table[p // block] * block + p % block for p in range(rows)], dtype=torch.long)
    norm = FinalNorm.from_checkpoint(model_dir, eps=json.loads((model_dir / "config.json").read_text())["rms_norm_eps"])
    times: dict[str, list[float]] = {"gather": [], "final norm": [], "ZMQ hop into the AR process": []}

    async def hop(sender: RowSender, channel: RowChannel, gathered: torch.Tensor, i: int) -> float:
        queue = channel.open_queue(f"readback-{i}", 1 << 30)
        started = time.perf_counter()
        sender.send(f"readback-{i}", 0, gathered, final=True)
        chunk = await queue.next(timeout=30)
        elapsed = time.perf_counter() - started
        channel.close_queue(f"readback-{i}")
        assert chunk.rows.shape == (rows, hidden)
        return elapsed

    with tempfile.TemporaryDirectory() as tmp:
        endpoint = f"ipc://{tmp}/rows.sock"
        channel = RowChannel(endpoint)
        sender = RowSender(endpoint)
        try:
            for i in range(reps + 1):
                t0 = time.perf_counter()
                gathered = kv[slots // block, 0, slots % block]
                t1 = time.perf_counter()
                normed = norm(gathered)
                t2 = time.perf_counter()
                moved = await hop(sender, channel, normed, i)
                if i:  # the first repetition warms caches and sockets
                    times["gather"].append(t1 - t0)
                    times["final norm"].append(t2 - t1)
                    times["ZMQ hop into the AR process"].append(moved)
        finally:
            sender.close()
            channel.close()
    return {part: paired.spread([t * 1e3 for t in values]) for part, values in times.items()}


async def measure(args: argparse.Namespace, engines: list[Engine], long: list[int]) -> dict:
    block = engines[0].engine.block_size
    cached = (len(long) - 1) // block * block
    tail = long[cached:]
    salt = "warm-ttft"
    for engine in engines:
        await request(engine, long, salt, 0)  # fills the cache: every later B2 is a verified hit
    samples: dict[str, dict[str, list[Sample]]] = {e.name: {"B2": [], "tail_only_cold": []} for e in engines}
    loads = []
    for round_ in range(args.rounds):
        loads.append(paired.load()["load_1m"])
        order = engines[round_ % 2 :] + engines[: round_ % 2]
        for engine in order:
            samples[engine.name]["B2"].append(await request(engine, long, salt, cached))
            fresh = f"tail-{round_}-{uuid.uuid4().hex[:6]}"
            samples[engine.name]["tail_only_cold"].append(await request(engine, tail, fresh, 0))
        print(f"round {round_ + 1}/{args.rounds}, load {loads[-1]}", flush=True)
    report: dict = {
        "prompt_tokens": len(long),
        "cached_tokens": cached,
        "tail_tokens": len(tail),
        "block_size": block,
        "load_1m_per_round": loads,
        "engines": {},
    }
    for engine in engines:
        entry = {}
        for workload, runs in samples[engine.name].items():
            entry[workload] = {
                "ttft_ms": paired.spread([s.ttft * 1e3 for s in runs]),
                "stages_ms_median": {
                    stage: round(statistics.median(s.stages[stage] for s in runs) * 1e3, 2) for stage in runs[0].stages
                },
            }
        report["engines"][engine.name] = entry

    def ratio(a: list[Sample], b: list[Sample]) -> dict:
        return paired.spread([x.ttft / y.ttft for x, y in zip(a, b, strict=True)])

    on, off = samples["capture_on"], samples["capture_off"]
    report["ratios"] = {
        "capture_on: B2 / tail-only TTFT": ratio(on["B2"], on["tail_only_cold"]),
        "capture_off: B2 / tail-only TTFT": ratio(off["B2"], off["tail_only_cold"]),
        "B2 TTFT: capture_on / capture_off": ratio(on["B2"], off["B2"]),
        "tail-only TTFT: capture_on / capture_off": ratio(on["tail_only_cold"], off["tail_only_cold"]),
    }
    report["capture_adds_to_B2_ms"] = paired.spread(
        [(x.ttft - y.ttft) * 1e3 for x, y in zip(on["B2"], off["B2"], strict=True)]
    )
    capture = next(e for e in engines if e.name == "capture_on")
    report["rows_readback_ms"] = {
        f"{len(long)} rows (B2)": await rows_readback(
            len(long), capture.engine.text_model.hidden_size, block, capture.engine.settings.model_dir, 20
        ),
        f"{len(tail)} rows (tail only)": await rows_readback(
            len(tail), capture.engine.text_model.hidden_size, block, capture.engine.settings.model_dir, 20
        ),
    }
    if args.profile_requests:
        report["profile_ms_per_request"] = {}
        for workload, prompt, expected in (("B2", long, cached), ("tail_only_cold", tail, 0)):
            spy = WorkerProfile(capture.core.pid)
            await asyncio.sleep(0.3)  # py-spy attaches
            for i in range(args.profile_requests):
                request_salt = salt if workload == "B2" else f"profile-{i}-{uuid.uuid4().hex[:6]}"
                await request(capture, prompt, request_salt, expected)
            report["profile_ms_per_request"][workload] = spy.stop(units=args.profile_requests)
        report["step_attribution_ms"] = step_attribution(report)
    return report


def step_attribution(report: dict) -> dict:
    """The engine step (scheduled -> first token, median) split by the profile's shares of in-step samples.

    py-spy's per-request figures also count the engine core's other threads and the time between
    requests, so only the split between the step's parts is taken from it, not its durations.
    """
    step = "scheduled -> first token in the engine core (the step)"
    split = {}
    for workload, profile in report["profile_ms_per_request"].items():
        parts = {name: ms for name, ms in profile["ms_per_unit"].items() if name != BETWEEN_STEPS}
        in_step = sum(parts.values())
        step_ms = report["engines"]["capture_on"][workload]["stages_ms_median"][step]
        split[workload] = {name: round(step_ms * ms / in_step, 1) for name, ms in parts.items()} | {"step": step_ms}
    return split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--long", type=int, default=5600)
    parser.add_argument("--profile-requests", type=int, default=10, help="0: no py-spy profile")
    parser.add_argument("--out", type=Path, default=paired.RESULTS / "warm_ttft.json")
    args = parser.parse_args()
    report: dict = {
        "command": f"python benchmarks/warm_ttft.py --rounds {args.rounds} --long {args.long} "
        f"--profile-requests {args.profile_requests}",
        "machine": paired.machine() | {"model": ArSettings().model_dir.name, "dtype": "float32"},
        "load_before": paired.load(),
    }
    started = time.time()
    engines: list[Engine] = []
    try:
        for name in ENGINES:
            engines.append(start(name))
        report |= asyncio.run(measure(args, engines, bench_engines.workload(args.long, 1)))
    finally:
        for engine in engines:
            engine.engine.shutdown()
    report["load_after"] = paired.load()
    report["wall_seconds"] = round(time.time() - started)
    b2_over_tail = report["ratios"]["capture_on: B2 / tail-only TTFT"]["p50"]
    report["targets"] = {"B2 <= 1.5x tail-only TTFT (capture on, median)": b2_over_tail <= 1.5}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"ratios": report["ratios"], "targets": report["targets"]}, indent=1))


if __name__ == "__main__":
    main()
