"""The fleet simulation's model: the cache, the policies, conservation, calibration, determinism."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest

from benchmarks.fleet_sim import (
    CALIBRATION_TOLERANCE,
    Fleet,
    PrefixCache,
    Request,
    Workload,
    block_keys,
    cached_tokens,
    calibrate,
    fit_measured_model,
    main,
    make_trace,
    simulate,
    summarize,
)

MODEL = fit_measured_model()
# Shared templates, several times one replica's cache in all, at a load four AR replicas carry.
SHARED = Workload(templates=32, rate_per_s=1.0, requests=600, seed=3)


def run(workload: Workload, fleet: Fleet) -> dict:
    trace = make_trace(workload)
    return summarize(trace, fleet, simulate(trace, fleet, MODEL, workload.new_tokens))


def test_the_cache_evicts_the_least_recently_used_block():
    cache = PrefixCache(capacity_blocks=2)
    cache.admit([("a",), ("b",)])
    cache.admit([("a",)])
    cache.admit([("c",)])
    assert cache.leading_hits([("a",), ("c",)]) == 2
    assert cache.leading_hits([("b",)]) == 0


def test_a_hit_counts_only_the_leading_blocks_present():
    cache = PrefixCache(capacity_blocks=8)
    cache.admit([("x", 0), ("x", 2)])
    assert cache.leading_hits([("x", 0), ("x", 1), ("x", 2)]) == 1


def test_a_hit_never_covers_the_last_prompt_token():
    assert cached_tokens(prompt_tokens=256, block_size=128, cached_blocks=2) == 128
    assert cached_tokens(prompt_tokens=257, block_size=128, cached_blocks=2) == 256


def test_requests_share_the_blocks_of_their_template_only():
    first, second = (Request(i, 0.0, template=5, template_tokens=300, prompt_tokens=300 + 200) for i in (1, 2))
    shared = set(block_keys(first, 128)) & set(block_keys(second, 128))
    assert len(shared) == 300 // 128 and len(block_keys(first, 128)) == 500 // 128


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded"])
def test_prefix_affinity_gets_more_prefix_hits_than_load_only_routing(policy):
    affinity = run(SHARED, Fleet(4, 4, "prefix-affinity"))
    other = run(SHARED, Fleet(4, 4, policy))
    assert affinity["hit_rate"] > other["hit_rate"] + 0.1


def test_without_shared_templates_no_policy_finds_prefix_hits():
    unshared = replace(SHARED, template_tokens=(0, 0))
    assert {run(unshared, Fleet(4, 4, p))["hit_rate"] for p in ("round-robin", "prefix-affinity")} == {0.0}


def test_every_arrived_request_is_completed_or_still_in_the_system():
    trace = make_trace(replace(SHARED, rate_per_s=4.0))
    cutoff = trace[len(trace) // 2].arrival_s + 0.001
    outcome = simulate(trace, Fleet(2, 1, "least-loaded"), MODEL, new_tokens=1, until_s=cutoff)
    assert outcome.arrived == sum(r.arrival_s <= cutoff for r in trace)
    assert outcome.in_system > 0 and outcome.completed > 0
    assert outcome.completed + outcome.in_system == outcome.arrived == len(trace) // 2 + 1
    assert len(outcome.latencies_s) == outcome.completed


def test_a_drained_run_completes_every_request():
    trace = make_trace(SHARED)
    outcome = simulate(trace, Fleet(4, 2, "prefix-affinity"), MODEL, new_tokens=1)
    assert outcome.completed == outcome.arrived == len(trace)


def test_one_ar_and_one_dit_predict_the_measured_single_host_latency():
    rows = calibrate(MODEL)
    assert {r["run"] for r in rows} == {
        "stream short cold",
        "stream short warm",
        "stream long cold",
        "stream long warm",
    }
    for row in rows:
        assert abs(row["relative_error"]) <= CALIBRATION_TOLERANCE, row


def test_warm_prompts_cost_the_ar_less_than_cold_ones():
    assert MODEL.ar_ms(5600, 5504, 1) < MODEL.ar_ms(5600, 0, 1) / 10


def test_the_same_seed_gives_the_same_result_and_another_seed_does_not():
    fleet = Fleet(4, 4, "prefix-affinity")
    assert run(SHARED, fleet) == run(SHARED, fleet)
    assert run(SHARED, fleet) != run(replace(SHARED, seed=4), fleet)


def test_a_slower_dit_needs_fewer_ar_replicas_per_dit(tmp_path, capsys):
    """Coefficients from a file replace the measured ones (GPU figures: there the DiT dominates)."""
    slow_dit = replace(MODEL, source="test: DiT 20 times slower", vae_decode_ms=MODEL.vae_decode_ms * 20)
    coefficients = tmp_path / "slow_dit.json"
    coefficients.write_text(json.dumps(asdict(slow_dit)))
    main(["--coefficients", str(coefficients), "--requests", "200", "--out", str(tmp_path / "fleet")])
    report = json.loads((tmp_path / "fleet.json").read_text())
    measured = run(SHARED, Fleet(4, 4, "prefix-affinity"))
    assert report["model"] == asdict(slow_dit) and report["calibration"] == []
    assert (
        report["balanced_ar_per_dit"]["prefix-affinity"]
        < measured["ar_ms_per_request"] / measured["dit_ms_per_request"]
    )
    assert capsys.readouterr().out.startswith("# Fleet simulation")  # the page's tables, printed
    assert (tmp_path / "fleet.png").stat().st_size > 0
