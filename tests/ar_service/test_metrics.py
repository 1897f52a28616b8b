"""The AR's families: known label values start at zero, and /metrics keeps showing the vLLM families
of the engine it runs even when another engine in the process registers its own."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Gauge

from ar_service.handoff_client import DitBusy, DitRejected, DitUnavailable
from ar_service.metrics import ROW_BUFFER_OVERFLOW, ArMetrics


def samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in registry.collect()
        for sample in family.samples
    }


def test_every_failure_reason_and_outcome_is_exported_at_zero_before_any_traffic():
    registry = CollectorRegistry()
    ArMetrics(registry)
    scraped = samples(registry)
    for reason in (DitBusy.reason, DitRejected.reason, DitUnavailable.reason, ROW_BUFFER_OVERFLOW):
        assert scraped[("ardit_ar_handoff_failures_total", frozenset({("reason", reason)}))] == 0
    for status in ("ok", "error"):
        assert scraped[("ardit_ar_requests_total", frozenset({("status", status)}))] == 0


def test_the_captured_engine_families_survive_another_engine_replacing_them():
    registry = CollectorRegistry()
    metrics = ArMetrics(registry)
    ours = Gauge("vllm:test_running", "this engine's", registry=REGISTRY)
    try:
        assert "vllm:test_running" not in {name for name, _ in samples(registry)}  # no engine yet
        metrics.vllm.capture()
        ours.set(3)
        # A second engine's logger unregisters every vllm: collector and registers its own.
        REGISTRY.unregister(ours)
        theirs = Gauge("vllm:test_running", "another engine's", registry=REGISTRY)
        theirs.set(7)
        assert samples(registry)[("vllm:test_running", frozenset())] == 3
        REGISTRY.unregister(theirs)
    finally:
        if ours in REGISTRY._collector_to_names:
            REGISTRY.unregister(ours)
