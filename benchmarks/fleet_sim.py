"""Size a fleet of N AR x M DiT replicas by discrete-event simulation (SimPy), before buying the GPUs.

Requests arrive as a Poisson stream. Each prompt is one of K shared templates (system prompts; their
popularity is Zipf-distributed) followed by the user's own text. A router sends each request to an AR
replica, chosen by one of three policies:

- ``round-robin``;
- ``least-loaded``: fewest requests outstanding on the replica;
- ``prefix-affinity``: the llm-d endpoint picker's weighted score, as deploy/kubernetes/epp.yaml
  configures it: 2 x (share of the prompt's blocks already in the replica's prefix cache)
  + 1 x (1 - KV-cache utilisation) + 1 x (queue score, 1 for the shortest queue, 0 for the longest).

An AR replica holds a prefix cache (LRU over blocks of B tokens, C tokens in all) and computes
``ar_slots`` requests at a time; the rest wait. A request's AR time is its prefill (from its uncached
and cached tokens) plus its decode. When it starts, the AR opens the handoff to the DiT replica with the
fewest outstanding handoffs (what each AR pod does over the headless Service); once the AR is done and
the handoff's tail has arrived, the request waits for that DiT's pipeline (one run at a time) and renders.

Service times come from ardit's own measurements (benchmarks/results/prefix_cache.json for prefill,
e2e.json for decode, handoff and the DiT stages), fitted as below; ``--coefficients FILE`` replaces
them (e.g. GPU figures, same keys as ``ServiceModel``). With N = M = 1 and one request at a time the
model must predict e2e.json's measured end-to-end latencies within CALIBRATION_TOLERANCE.

    python benchmarks/fleet_sim.py [--requests 3000] [--seed 7] [--coefficients gpu.json]

Writes benchmarks/results/fleet_sim.json and fleet_sim.png, and prints the tables of the page,
benchmarks/results/fleet_sim.md (which adds what they are and how to read them).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import simpy
from matplotlib.figure import Figure

RESULTS = Path(__file__).resolve().parent / "results"
# Largest relative error allowed between predicted and measured single-request latency (N = M = 1).
CALIBRATION_TOLERANCE = 0.15
POLICIES = ("round-robin", "least-loaded", "prefix-affinity")
# The llm-d scorer weights of deploy/kubernetes/epp.yaml.
PREFIX_WEIGHT, KV_WEIGHT, QUEUE_WEIGHT = 2.0, 1.0, 1.0


# --- service times -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServiceModel:
    """Per-stage service times in milliseconds.

    prefill = intercept + per_uncached x u + attention x u x (c + u/2) / 1000 + per_cached x c
    for u uncached and c cached prompt tokens (each new token attends to the c cached tokens and, on
    average, half the new ones); decode = decode_per_token x (new tokens - 1), the first token being
    the prefill's; DiT = denoise_intercept + denoise_per_prompt_token x prompt tokens + VAE + encode.
    """

    source: str
    block_size: int
    prefill_intercept_ms: float
    prefill_per_uncached_token_ms: float
    prefill_attention_ms: float
    prefill_per_cached_token_ms: float
    decode_per_token_ms: float
    handoff_tail_ms: float
    denoise_intercept_ms: float
    denoise_per_prompt_token_ms: float
    vae_decode_ms: float
    encode_ms: float

    def prefill_ms(self, uncached: int, cached: int) -> float:
        return (
            self.prefill_intercept_ms
            + self.prefill_per_uncached_token_ms * uncached
            + self.prefill_attention_ms * uncached * (cached + uncached / 2) / 1000
            + self.prefill_per_cached_token_ms * cached
        )

    def ar_ms(self, prompt_tokens: int, cached: int, new_tokens: int) -> float:
        return self.prefill_ms(prompt_tokens - cached, cached) + self.decode_per_token_ms * (new_tokens - 1)

    def dit_ms(self, prompt_tokens: int) -> float:
        denoise = self.denoise_intercept_ms + self.denoise_per_prompt_token_ms * prompt_tokens
        return denoise + self.vae_decode_ms + self.encode_ms


def cached_tokens(prompt_tokens: int, block_size: int, cached_blocks: int) -> int:
    """vLLM recomputes the last prompt token: a hit covers at most (P - 1) // B full blocks."""
    return min(cached_blocks, (prompt_tokens - 1) // block_size) * block_size


def fit_measured_model(results: Path = RESULTS) -> ServiceModel:
    """The CPU figures: least squares on the measured points (the prefill fit has as many points as
    coefficients, so it passes through them; e2e.json's TTFTs are left out of it and checked by the
    calibration)."""
    prefix = json.loads((results / "prefix_cache.json").read_text())
    scenarios = prefix["engines"]["caching_on_capture_on"]["scenarios"]
    block_size = scenarios[0]["block_size"]
    rows, ttft = [], []
    for s in scenarios:
        cached = s["expected_cached_tokens"]
        uncached = s["prompt_tokens"] - cached
        rows.append([1.0, uncached, uncached * (cached + uncached / 2) / 1000, cached])
        ttft.append(s["ttft_ms"]["mean"])
    prefill = np.linalg.lstsq(np.array(rows), np.array(ttft), rcond=None)[0]

    e2e = json.loads((results / "e2e.json").read_text())
    new_tokens = int(e2e["command"].split("--new-tokens")[1].split()[0])
    streamed = [run for name, run in e2e["runs"].items() if name.startswith("stream")]
    samples = [sample for run in streamed for sample in run["samples"]]
    decode = float(np.median([s["decode"] / (new_tokens - 1) for s in samples]))
    denoise = np.polyfit([s["prompt_tokens"] for s in samples], [s["dit_denoise"] for s in samples], 1)
    return ServiceModel(
        source="fitted to benchmarks/results/prefix_cache.json (prefill) and e2e.json (decode, handoff, DiT)",
        block_size=block_size,
        prefill_intercept_ms=float(prefill[0]),
        prefill_per_uncached_token_ms=float(prefill[1]),
        prefill_attention_ms=float(prefill[2]),
        prefill_per_cached_token_ms=float(prefill[3]),
        decode_per_token_ms=decode,
        handoff_tail_ms=float(np.median([s["handoff_tail"] for s in samples])),
        denoise_intercept_ms=float(denoise[1]),
        denoise_per_prompt_token_ms=float(denoise[0]),
        vae_decode_ms=float(np.median([s["dit_vae_decode"] for s in samples])),
        encode_ms=float(np.median([s["dit_encode"] for s in samples])),
    )


# --- workload ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    templates: int = 32
    zipf_exponent: float = 1.1
    template_tokens: tuple[int, int] = (400, 2000)
    user_tokens_median: float = 60.0
    user_tokens_sigma: float = 0.6
    new_tokens: int = 1
    rate_per_s: float = 1.0
    requests: int = 3000
    seed: int = 7


@dataclass(frozen=True)
class Request:
    id: int
    arrival_s: float
    template: int
    template_tokens: int
    prompt_tokens: int


def make_trace(workload: Workload) -> list[Request]:
    rng = np.random.default_rng(workload.seed)
    low, high = workload.template_tokens
    lengths = rng.integers(low, high + 1, size=workload.templates)
    popularity = 1.0 / np.arange(1, workload.templates + 1) ** workload.zipf_exponent
    templates = rng.choice(workload.templates, size=workload.requests, p=popularity / popularity.sum())
    user = np.maximum(
        1, rng.lognormal(math.log(workload.user_tokens_median), workload.user_tokens_sigma, size=workload.requests)
    ).astype(int)
    arrivals = np.cumsum(rng.exponential(1.0 / workload.rate_per_s, size=workload.requests))
    return [
        Request(i, float(arrivals[i]), int(t), int(lengths[t]), int(lengths[t] + user[i]))
        for i, t in enumerate(templates)
    ]


def block_keys(request: Request, block_size: int) -> list[tuple]:
    """Full blocks of the prompt. Blocks inside the template are shared by every request using it
    (vLLM's chained block hashes make them equal); the others are this request's own."""
    shared = request.template_tokens // block_size
    return [
        ("template", request.template, i) if i < shared else ("request", request.id, i)
        for i in range(request.prompt_tokens // block_size)
    ]


class PrefixCache:
    """LRU over blocks, as vLLM's free-block queue evicts them."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[tuple, None] = OrderedDict()

    def leading_hits(self, keys: Sequence[tuple]) -> int:
        hits = 0
        for key in keys:
            if key not in self._blocks:
                break
            hits += 1
        return hits

    def admit(self, keys: Sequence[tuple]) -> None:
        for key in keys:
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)


# --- the fleet -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fleet:
    ar_replicas: int
    dit_replicas: int
    policy: str
    cache_tokens: int = 12_000
    ar_slots: int = 1


@dataclass
class ArReplica:
    cache: PrefixCache
    slots: simpy.Resource
    outstanding: int = 0
    tokens_in_flight: int = 0
    busy_s: float = 0.0


@dataclass
class DitReplica:
    pipeline: simpy.Resource
    outstanding: int = 0
    busy_s: float = 0.0


@dataclass
class Outcome:
    arrived: int = 0
    completed: int = 0
    latencies_s: dict[int, float] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ar_busy_s: float = 0.0
    dit_busy_s: float = 0.0
    finished_s: float = 0.0

    @property
    def in_system(self) -> int:
        return self.arrived - self.completed


Router = Callable[[Sequence[ArReplica], list[tuple], int], int]


def round_robin() -> Router:
    turn = itertools.count()
    return lambda replicas, keys, capacity: next(turn) % len(replicas)


def least_loaded() -> Router:
    return lambda replicas, keys, capacity: min(range(len(replicas)), key=lambda i: replicas[i].outstanding)


def prefix_affinity() -> Router:
    """llm-d's max-score picker over prefix-cache, KV-utilisation and queue scorers (first index on ties)."""

    def choose(replicas: Sequence[ArReplica], keys: list[tuple], capacity: int) -> int:
        queues = [r.outstanding for r in replicas]
        low, high = min(queues), max(queues)

        def score(i: int) -> float:
            r = replicas[i]
            prefix = r.cache.leading_hits(keys) / len(keys) if keys else 0.0
            kv = 1.0 - min(1.0, r.tokens_in_flight / capacity)
            queue = 1.0 if high == low else (high - queues[i]) / (high - low)
            return PREFIX_WEIGHT * prefix + KV_WEIGHT * kv + QUEUE_WEIGHT * queue

        return max(range(len(replicas)), key=score)

    return choose


ROUTERS: dict[str, Callable[[], Router]] = {
    "round-robin": round_robin,
    "least-loaded": least_loaded,
    "prefix-affinity": prefix_affinity,
}


def simulate(
    trace: Sequence[Request], fleet: Fleet, model: ServiceModel, new_tokens: int, until_s: float | None = None
) -> Outcome:
    env = simpy.Environment()
    capacity_blocks = fleet.cache_tokens // model.block_size
    ars = [
        ArReplica(PrefixCache(capacity_blocks), simpy.Resource(env, capacity=fleet.ar_slots))
        for _ in range(fleet.ar_replicas)
    ]
    dits = [DitReplica(simpy.Resource(env, capacity=1)) for _ in range(fleet.dit_replicas)]
    route = ROUTERS[fleet.policy]()
    outcome = Outcome()

    def serve(request: Request):
        keys = block_keys(request, model.block_size)
        ar = ars[route(ars, keys, fleet.cache_tokens)]
        ar.outstanding += 1
        ar.tokens_in_flight += request.prompt_tokens
        with ar.slots.request() as slot:
            yield slot
            dit = min(dits, key=lambda d: d.outstanding)
            dit.outstanding += 1
            cached = cached_tokens(request.prompt_tokens, model.block_size, ar.cache.leading_hits(keys))
            ar.cache.admit(keys)
            service_s = model.ar_ms(request.prompt_tokens, cached, new_tokens) / 1000
            outcome.prompt_tokens += request.prompt_tokens
            outcome.cached_tokens += cached
            outcome.ar_busy_s += service_s
            yield env.timeout(service_s)
        ar.outstanding -= 1
        ar.tokens_in_flight -= request.prompt_tokens
        yield env.timeout(model.handoff_tail_ms / 1000)
        with dit.pipeline.request() as run:
            yield run
            service_s = model.dit_ms(request.prompt_tokens) / 1000
            outcome.dit_busy_s += service_s
            yield env.timeout(service_s)
        dit.outstanding -= 1
        outcome.completed += 1
        outcome.latencies_s[request.id] = env.now - request.arrival_s
        outcome.finished_s = env.now

    def arrivals():
        for request in trace:
            yield env.timeout(request.arrival_s - env.now)
            outcome.arrived += 1
            env.process(serve(request))

    env.process(arrivals())
    env.run(until=until_s)
    return outcome


# --- reports -------------------------------------------------------------------------------------------


def summarize(trace: Sequence[Request], fleet: Fleet, outcome: Outcome, warmup: float = 0.1) -> dict:
    """Latency over the requests after the first `warmup` share (the caches start empty); throughput and
    utilisation over the whole run, first arrival to last completion."""
    first = int(len(trace) * warmup)
    latencies = np.array([outcome.latencies_s[r.id] for r in trace[first:]]) * 1000
    span = outcome.finished_s - trace[0].arrival_s
    return {
        "policy": fleet.policy,
        "ar_replicas": fleet.ar_replicas,
        "dit_replicas": fleet.dit_replicas,
        "hit_rate": outcome.cached_tokens / outcome.prompt_tokens,
        "p50_ms": float(np.percentile(latencies, 50)),
        "p99_ms": float(np.percentile(latencies, 99)),
        "throughput_rps": outcome.completed / span,
        "ar_utilisation": outcome.ar_busy_s / (fleet.ar_replicas * fleet.ar_slots * span),
        "dit_utilisation": outcome.dit_busy_s / (fleet.dit_replicas * span),
        "ar_ms_per_request": 1000 * outcome.ar_busy_s / outcome.completed,
        "dit_ms_per_request": 1000 * outcome.dit_busy_s / outcome.completed,
    }


def calibrate(model: ServiceModel, results: Path = RESULTS) -> list[dict]:
    """Replay e2e.json's streamed runs one request at a time on N = M = 1: cold on an empty cache, warm
    after the same prompt once; compare with the measured median end-to-end latency."""
    e2e = json.loads((results / "e2e.json").read_text())
    new_tokens = int(e2e["command"].split("--new-tokens")[1].split()[0])
    rows = []
    for name, run in e2e["runs"].items():
        if not name.startswith("stream"):
            continue
        prompt = int(run["median_ms"]["prompt_tokens"])
        # The template is the whole prompt: the repeat of a warm run shares all of its full blocks.
        first = Request(0, 0.0, template=0, template_tokens=prompt, prompt_tokens=prompt)
        trace = [first, Request(1, 1000.0, 0, prompt, prompt)] if name.endswith("warm") else [first]
        outcome = simulate(trace, Fleet(1, 1, "round-robin"), model, new_tokens)
        predicted = outcome.latencies_s[trace[-1].id] * 1000
        measured = run["median_ms"]["total"]
        rows.append(
            {
                "run": name,
                "prompt_tokens": prompt,
                "measured_ms": measured,
                "predicted_ms": predicted,
                "relative_error": (predicted - measured) / measured,
            }
        )
    return rows


def balanced_ratio(row: dict) -> float:
    """AR replicas per DiT replica that keep both tiers equally busy: their service demand per request."""
    return row["ar_ms_per_request"] / row["dit_ms_per_request"]


def markdown(report: dict) -> str:
    lines = [
        "# Fleet simulation",
        "",
        f"`{report['command']}` — service times: {report['model']['source']}.",
        "",
        "## Calibration: N = M = 1, one request at a time, against e2e.json",
        "",
        "| run | prompt tokens | measured | predicted | error |",
        "|---|---|---|---|---|",
    ]
    for row in report["calibration"]:
        lines.append(
            f"| {row['run']} | {row['prompt_tokens']} | {row['measured_ms']:.0f} ms | {row['predicted_ms']:.0f} ms "
            f"| {row['relative_error']:+.1%} |"
        )
    if report["calibration"]:
        verdict = f"Largest error {report['calibration_max_abs_error']:.1%} (allowed {CALIBRATION_TOLERANCE:.0%})."
    else:
        verdict = "Not calibrated here: the coefficients came from a file, e2e.json measured the CPU model."
    lines += [
        "",
        verdict,
        "",
        f"## 4 AR x 4 DiT at {report['comparison_rate_per_s']:g} requests/s",
        "",
        "| policy | prefix hit rate | throughput | p50 | p99 | AR busy | DiT busy | AR:DiT for equal load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report["comparison_4x4"]:
        lines.append(
            f"| {row['policy']} | {row['hit_rate']:.1%} | {row['throughput_rps']:.2f}/s | {row['p50_ms']:.0f} ms "
            f"| {row['p99_ms']:.0f} ms | {row['ar_utilisation']:.0%} | {row['dit_utilisation']:.0%} "
            f"| {balanced_ratio(row):.2f} : 1 |"
        )
    lines += [
        "",
        "Throughput counts first arrival to last completion. Past a policy's capacity its queue grows for the "
        "whole run: throughput is then that capacity, and p50/p99 measure the trace's length, not a steady state.",
        "",
        "## Load sweep, 4 AR x 4 DiT",
        "",
        "| rate | policy | hit rate | throughput | p50 | p99 |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["load_sweep"]:
        lines.append(
            f"| {row['rate_per_s']:g}/s | {row['policy']} | {row['hit_rate']:.1%} | {row['throughput_rps']:.2f}/s "
            f"| {row['p50_ms']:.0f} ms | {row['p99_ms']:.0f} ms |"
        )
    lines += [
        "",
        f"## N:M at {report['ratio_rate_per_s']:g} requests/s, N = 4, prefix-affinity",
        "",
        "| AR x DiT | throughput | p99 | AR busy | DiT busy |",
        "|---|---|---|---|---|",
    ]
    for row in report["ratio_sweep"]:
        lines.append(
            f"| {row['ar_replicas']} x {row['dit_replicas']} | {row['throughput_rps']:.2f}/s | {row['p99_ms']:.0f} ms "
            f"| {row['ar_utilisation']:.0%} | {row['dit_utilisation']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Drawn with matplotlib's Figure API: no pyplot state, no display needed."""
    fig = Figure(figsize=(11, 4))
    latency, hits = fig.subplots(1, 2)
    for policy in POLICIES:
        rows = [r for r in report["load_sweep"] if r["policy"] == policy]
        rates = [r["rate_per_s"] for r in rows]
        latency.plot(rates, [r["p99_ms"] / 1000 for r in rows], marker="o", label=policy)
        hits.plot(rates, [100 * r["hit_rate"] for r in rows], marker="o", label=policy)
    latency.set(
        xlabel="offered load (requests/s)",
        ylabel="p99 latency (s)",
        yscale="log",
        title="4 AR x 4 DiT: p99 end-to-end latency",
    )
    hits.set(
        xlabel="offered load (requests/s)",
        ylabel="prefix-cache hit rate (% of prompt tokens)",
        title="4 AR x 4 DiT: prefix-cache hit rate",
        ylim=(0, 100),
    )
    for axes in (latency, hits):
        axes.grid(True, alpha=0.3)
        axes.legend()
    workload = report["workload"]
    fig.suptitle(
        f"ardit fleet simulation, {workload['requests']} requests per point, seed {workload['seed']}; "
        f"service times {report['model']['source']}",
        fontsize=7,
        wrap=True,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--coefficients", type=Path, help="JSON with ServiceModel's fields (e.g. GPU figures)")
    parser.add_argument("--rate", type=float, help="requests/s of the 4x4 comparison (default: from the model)")
    parser.add_argument("--out", type=Path, default=RESULTS / "fleet_sim")
    args = parser.parse_args(argv)

    started = time.monotonic()
    # Calibration replays this repository's own end-to-end measurement: it checks the fitted CPU model;
    # coefficients from elsewhere need their own measurement to be checked against.
    if args.coefficients:
        model = ServiceModel(**json.loads(args.coefficients.read_text()))
        calibration = []
    else:
        model = fit_measured_model()
        calibration = calibrate(model)
    base = Workload(requests=args.requests, seed=args.seed)
    # Scale the load to the model: the rate 4 AR replicas sustain if every prompt were a cold miss.
    mean_prompt = (sum(base.template_tokens) / 2) + base.user_tokens_median
    cold_s = model.ar_ms(int(mean_prompt), 0, base.new_tokens) / 1000
    cold_capacity = 4 / cold_s
    rate = args.rate or round(2 * cold_capacity, 2)

    def run(fleet: Fleet, rate_per_s: float) -> dict:
        workload = Workload(**{**asdict(base), "rate_per_s": rate_per_s})
        trace = make_trace(workload)
        return summarize(trace, fleet, simulate(trace, fleet, model, workload.new_tokens)) | {"rate_per_s": rate_per_s}

    comparison = [run(Fleet(4, 4, policy), rate) for policy in POLICIES]
    sweep_rates = [round(cold_capacity * f, 2) for f in (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0)]
    load_sweep = [run(Fleet(4, 4, policy), r) for r in sweep_rates for policy in POLICIES]
    ratio_sweep = [run(Fleet(4, m, "prefix-affinity"), rate) for m in (1, 2, 3, 4)]
    report = {
        "command": " ".join(["python", "benchmarks/fleet_sim.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": {"node": platform.platform(), "python": platform.python_version()},
        "model": asdict(model),
        "workload": asdict(base),
        "fleet_defaults": {k: v for k, v in asdict(Fleet(4, 4, "prefix-affinity")).items() if k != "policy"},
        "calibration": calibration,
        "calibration_max_abs_error": max((abs(r["relative_error"]) for r in calibration), default=None),
        "calibration_tolerance": CALIBRATION_TOLERANCE,
        "cold_capacity_4_ar_per_s": cold_capacity,
        "comparison_rate_per_s": rate,
        "comparison_4x4": comparison,
        "balanced_ar_per_dit": {row["policy"]: balanced_ratio(row) for row in comparison},
        "load_sweep": load_sweep,
        "ratio_rate_per_s": rate,
        "ratio_sweep": ratio_sweep,
        "wall_seconds": round(time.monotonic() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print(markdown(report))


if __name__ == "__main__":
    main()
