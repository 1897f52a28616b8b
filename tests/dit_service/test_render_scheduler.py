"""When jobs run: alone without batching; with batching, compatible waiting jobs as one run."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable
from typing import cast

import pytest
import torch
from prometheus_client import CollectorRegistry

from dit_service.conditioning import Conditioning
from dit_service.metrics import DitMetrics
from dit_service.render_job import RenderCancelled, RenderJob, RenderTimings
from dit_service.render_scheduler import RenderScheduler
from dit_service.renderer import Renderer
from services.heap import IdleRelease, return_free_pages_in_thread
from tests.dit_service.handoff_requests import params
from tests.support.waiting import until

COND = Conditioning(torch.zeros(1, 1, 4), torch.ones(1, 1, dtype=torch.long))


class Recorder:
    """Stands in for the renderer: records what ran together (denoise 1 s alone, 2 s in a batch), takes a
    little time."""

    batches = True

    def __init__(self) -> None:
        self.runs: list[list[str]] = []

    def render(self, items) -> list:
        self.runs.append([item.job.request_id for item in items])
        time.sleep(0.05)
        denoise = 1.0 if len(items) == 1 else 2.0
        return [RenderCancelled() if item.cancel.is_set() else RenderTimings(denoise=denoise) for item in items]


def job(name: str, **overrides) -> RenderJob:
    return RenderJob(name, COND, params(**overrides))


def schedule(jobs: list[RenderJob], max_batch: int, cancelled: Iterable[str] = frozenset(), batches: bool = True):
    recorder = Recorder()
    recorder.batches = batches

    async def scenario():
        metrics = DitMetrics(CollectorRegistry())
        scheduler = RenderScheduler(
            cast(Renderer, recorder),
            asyncio.Semaphore(1),
            metrics,
            max_batch_size=max_batch,
            window=0.02,
            idle=IdleRelease(0, return_free_pages_in_thread),
        )
        cancels = {j.request_id: threading.Event() for j in jobs}
        for name in cancelled:
            cancels[name].set()
        results = await asyncio.gather(
            *(scheduler.run(j, lambda frame: None, cancels[j.request_id]) for j in jobs), return_exceptions=True
        )
        return results, metrics

    results, metrics = asyncio.run(scenario())
    return recorder.runs, results, metrics


def test_without_batching_every_job_runs_alone_in_order():
    runs, results, _ = schedule([job("a"), job("b"), job("c")], max_batch=1)
    assert runs == [["a"], ["b"], ["c"]] and all(r[0].denoise == 1.0 for r in results)


def test_with_batching_compatible_waiting_jobs_share_one_run_and_the_rest_keep_their_place():
    jobs = [job("a"), job("b"), job("odd", width=48), job("c"), job("d", num_images=2)]
    runs, results, metrics = schedule(jobs, max_batch=8)
    assert runs == [["a", "b", "c"], ["odd"], ["d"]]
    assert [r[0].denoise for r in results] == [2.0, 2.0, 1.0, 2.0, 1.0]
    assert metrics.pipeline_queue_depth._value.get() == 0 and metrics.pipeline_runs_in_flight._value.get() == 0


def test_a_family_whose_pipeline_refuses_a_batch_runs_every_job_alone_with_batching_on():
    """Qwen-Image-Edit's pipeline refuses a batch (its card: ``batches=False``): compatible jobs never share a run."""
    runs, results, _ = schedule([job("a"), job("b"), job("c")], max_batch=8, batches=False)
    assert runs == [["a"], ["b"], ["c"]] and all(r[0].denoise == 1.0 for r in results)


def test_a_batch_holds_at_most_its_maximum():
    runs, _, _ = schedule([job(name) for name in "abcde"], max_batch=2)
    assert runs == [["a", "b"], ["c", "d"], ["e"]]


def test_a_job_whose_consumer_left_while_queued_does_not_run():
    runs, results, _ = schedule([job("a"), job("b"), job("c")], max_batch=8, cancelled={"b"})
    assert runs[0] == ["a", "c"]
    assert isinstance(results[1], RenderCancelled)


@pytest.mark.parametrize("max_batch", [1, 8])
def test_queue_waits_are_measured(max_batch):
    _, results, metrics = schedule([job("a"), job("b")], max_batch=max_batch)
    assert all(seconds >= 0 for _, seconds in results)
    assert metrics.queue_wait_seconds._sum.get() >= 0


@pytest.mark.parametrize("max_batch", [1, 8])
def test_free_memory_goes_back_once_no_run_is_in_flight_never_during_one(max_batch):
    recorder = Recorder()
    released_while_rendering: list[int] = []

    async def release() -> int:
        released_while_rendering.append(len(recorder.runs) - finished[0])
        return 0

    finished = [0]

    async def scenario() -> IdleRelease:
        idle = IdleRelease(0.02, release)
        scheduler = RenderScheduler(
            cast(Renderer, recorder),
            asyncio.Semaphore(1),
            DitMetrics(CollectorRegistry()),
            max_batch_size=max_batch,
            window=0.0,
            idle=idle,
        )
        for name in ("a", "b"):
            await scheduler.run(job(name), lambda frame: None, threading.Event())
            finished[0] += 1
        before = idle.releases  # 0 unless one came while there was work: the assertions below catch it
        await until(lambda: idle.releases > before, what="the release once both had run")
        await idle.aclose()
        return idle

    idle = asyncio.run(scenario())
    assert idle.releases == 1 and released_while_rendering == [0]
