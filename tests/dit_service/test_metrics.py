"""The DiT's families: known label values start at zero, the pipeline queue counts waiters (and only
waiters), GPU memory is exported on CUDA only."""

from __future__ import annotations

import asyncio

import torch
from prometheus_client import CollectorRegistry, Gauge

from dit_service.metrics import DitMetrics, handoff_failure_reasons, waiting_for
from shared import errors


def samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in registry.collect()
        for sample in family.samples
    }


def test_every_failure_reason_and_format_is_exported_at_zero_before_any_traffic():
    registry = CollectorRegistry()
    DitMetrics(registry)
    scraped = samples(registry)
    for reason in ("checksum_mismatch", "handoff_stalled", "prompt_too_long", "client_disconnected"):
        assert scraped[("ardit_dit_handoff_failures_total", frozenset({("reason", reason)}))] == 0
    assert {errors.ChecksumMismatch.code, errors.IncompleteStream.code} <= set(handoff_failure_reasons())
    for output_format in ("png", "jpeg", "webp"):
        assert scraped[("ardit_dit_images_total", frozenset({("format", output_format)}))] == 0
    for reason in ("error", "client_disconnected"):
        assert scraped[("ardit_dit_pipeline_failures_total", frozenset({("reason", reason)}))] == 0


def test_the_queue_gauge_counts_callers_still_waiting_for_a_slot():
    waiting = Gauge("waiting", "", registry=None)

    async def scenario() -> list[float]:
        slots = asyncio.Semaphore(1)
        seen = []
        async with waiting_for(slots, waiting):
            second = asyncio.ensure_future(hold(slots))
            third = asyncio.ensure_future(hold(slots))
            await asyncio.sleep(0)
            seen.append(waiting._value.get())  # two wait while one runs
            third.cancel()
            await asyncio.sleep(0)
            seen.append(waiting._value.get())  # a caller that gave up no longer waits
        await second
        seen.append(waiting._value.get())
        return seen

    async def hold(slots: asyncio.Semaphore) -> None:
        async with waiting_for(slots, waiting):
            await asyncio.sleep(0)

    assert asyncio.run(scenario()) == [2, 1, 0]


def test_gpu_memory_is_exported_only_for_a_cuda_pipeline(monkeypatch):
    cpu = CollectorRegistry()
    DitMetrics(cpu, cuda_device=torch.device("cpu"))
    assert not [name for name, _ in samples(cpu) if "gpu_memory" in name]
    # No GPU here: PyTorch's allocator counters stand in for one (the gauges read them at scrape time).
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: (3 << 30) * (device == torch.device("cuda:1")))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: (4 << 30) * (device == torch.device("cuda:1")))
    cuda = CollectorRegistry()
    DitMetrics(cuda, cuda_device=torch.device("cuda:1"))
    scraped = samples(cuda)
    assert scraped[("ardit_dit_gpu_memory_allocated_bytes", frozenset())] == 3 << 30
    assert scraped[("ardit_dit_gpu_memory_reserved_bytes", frozenset())] == 4 << 30
