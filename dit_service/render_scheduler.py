"""When render jobs run: under the run slots, in arrival order, and — with batching on — several
compatible jobs waiting together as one run of the ``Renderer``.

Without batching (``max_batch_size`` 1, the default, or a model family that does not batch:
``dit_service.families``) each job takes a run slot and renders alone.
With batching, the job at the head of the queue waits ``window`` seconds once it has a slot, then
takes with it up to ``max_batch_size - 1`` later jobs that share its ``batch_key``; the rest keep
their places. A batch is one pipeline run: it holds one run slot.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from dit_service.metrics import DitMetrics, waiting_for
from dit_service.render_job import EmitResult, RenderCancelled, RenderItem, RenderJob, RenderOutcome, RenderTimings
from dit_service.renderer import Renderer
from services.heap import IdleRelease

RunOutcome = tuple[RenderTimings, float]  # the job's timings, and how long it waited for its run


@dataclass
class _Waiting:
    item: RenderItem
    queued_at: float = field(default_factory=time.monotonic)
    outcome: asyncio.Future[RunOutcome] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class RenderScheduler:
    renderer: Renderer
    run_slots: asyncio.Semaphore
    metrics: DitMetrics
    max_batch_size: int
    window: float
    # Gives the render threads' freed activations back once no run is in flight (services.heap).
    idle: IdleRelease
    _waiting: deque[_Waiting] = field(default_factory=deque, init=False)
    _dispatcher: asyncio.Task[None] | None = field(default=None, init=False)
    # Strong references: the event loop only keeps weak ones to tasks.
    _runs: set[asyncio.Task[None]] = field(default_factory=set, init=False)

    async def run(self, job: RenderJob, emit: EmitResult, cancel: threading.Event) -> RunOutcome:
        """Render ``job`` when its turn comes; RenderCancelled if its consumer left meanwhile."""
        if self.max_batch_size == 1 or not self.renderer.batches:
            return await self._alone(job, emit, cancel)
        waiting = _Waiting(RenderItem(job, emit, cancel))
        self._waiting.append(waiting)
        self.metrics.pipeline_queue_depth.inc()
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = asyncio.create_task(self._dispatch())
        return await asyncio.shield(waiting.outcome)

    async def _alone(self, job: RenderJob, emit: EmitResult, cancel: threading.Event) -> RunOutcome:
        metrics, waited = self.metrics, time.monotonic()
        async with waiting_for(self.run_slots, metrics.pipeline_queue_depth):
            queue_seconds = self._started([job], waited)[0]
            if cancel.is_set():
                raise RenderCancelled()
            metrics.pipeline_runs_in_flight.inc()
            try:
                (outcome,) = await self._render([RenderItem(job, emit, cancel)])
            finally:
                metrics.pipeline_runs_in_flight.dec()
        if isinstance(outcome, RenderCancelled):
            raise outcome
        return outcome, queue_seconds

    async def _dispatch(self) -> None:
        while self._waiting:
            await self.run_slots.acquire()
            await asyncio.sleep(self.window)  # let compatible jobs arrive
            batch = self._take_batch()
            if not batch:
                self.run_slots.release()
                continue
            run = asyncio.create_task(self._run_batch(batch))
            self._runs.add(run)
            run.add_done_callback(self._runs.discard)

    def _take_batch(self) -> list[_Waiting]:
        """The head of the queue and, if it can batch, later jobs that share its key."""
        batch: list[_Waiting] = []
        while self._waiting and not batch:
            head = self._waiting.popleft()
            self.metrics.pipeline_queue_depth.dec()
            if head.item.cancel.is_set():
                head.outcome.set_exception(RenderCancelled())
                continue
            batch.append(head)
        key = batch[0].item.job.batch_key if batch else None
        if key is not None:
            for waiting in list(self._waiting):
                if len(batch) == self.max_batch_size:
                    break
                if waiting.item.job.batch_key == key and not waiting.item.cancel.is_set():
                    self._waiting.remove(waiting)
                    self.metrics.pipeline_queue_depth.dec()
                    batch.append(waiting)
        return batch

    async def _run_batch(self, batch: list[_Waiting]) -> None:
        metrics = self.metrics
        queue_seconds = self._started([w.item.job for w in batch], [w.queued_at for w in batch])
        metrics.pipeline_runs_in_flight.inc(len(batch))
        try:
            results = await self._render([w.item for w in batch])
        except BaseException as exc:  # every job of the run failed with it
            for waiting in batch:
                if not waiting.outcome.done():
                    waiting.outcome.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            for waiting, result, seconds in zip(batch, results, queue_seconds, strict=True):
                if isinstance(result, RenderCancelled):
                    waiting.outcome.set_exception(result)
                else:
                    waiting.outcome.set_result((result, seconds))
        finally:
            metrics.pipeline_runs_in_flight.dec(len(batch))
            self.run_slots.release()

    async def _render(self, items: list[RenderItem]) -> list[RenderOutcome]:
        async with self.idle.in_flight():
            return await asyncio.to_thread(self.renderer.render, items)

    def _started(self, jobs: list[RenderJob], queued_at: float | list[float]) -> list[float]:
        """Record that these jobs' run starts now; their queue waits, in seconds."""
        now = time.monotonic()
        starts = queued_at if isinstance(queued_at, list) else [queued_at] * len(jobs)
        waits = [now - start for start in starts]
        for job, seconds in zip(jobs, waits, strict=True):
            self.metrics.queue_wait_seconds.observe(seconds)
            job.trace.queued(seconds)
        return waits
