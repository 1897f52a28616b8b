"""The answer to a complete handoff: result frames streamed while the pipeline runs.

The run happens in a worker thread under the run semaphore and reports frames back to the event
loop through a queue, so previews and images reach the sender as soon as they exist. The run is a
task of its own, not part of the response: if the client disconnects, the response is cancelled,
the run is told to stop at its next denoising step, and the run slot and the request's place are only
given back once the thread has actually finished (so capacity accounting never lies).

The sender is never left in silence longer than ``progress_interval``: a ``progress`` frame goes
out when nothing else did (queued, or a long step), so silence means this process is frozen.
A pipeline that fails ``max_consecutive_failures`` runs in a row cannot run any more: that is
fatal (the process exits and its supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from dit_service.admission import Place
from dit_service.metrics import DitMetrics
from dit_service.render_job import EmitResult, RenderCancelled, RenderJob, RenderTimings
from dit_service.render_scheduler import RenderScheduler
from services.fatal import Fatal
from shared.result_frames import (
    RESULT_MEDIA_TYPE,
    DoneFrame,
    ErrorFrame,
    ImageFrame,
    PartialImageFrame,
    ProgressFrame,
    encode_result,
)

log = logging.getLogger("ardit.dit.results")


@dataclass(frozen=True)
class _RunEnded:
    timings: RenderTimings | None  # None: the run did not finish
    queue_seconds: float


@dataclass
class ResultStream:
    scheduler: RenderScheduler
    metrics: DitMetrics
    fatal: Fatal
    progress_interval: float
    max_consecutive_failures: int
    _failures_in_a_row: int = field(default=0, init=False)
    # Strong references: the event loop only keeps weak ones to tasks.
    _runs: set[asyncio.Task[None]] = field(default_factory=set, init=False)

    def respond(self, job: RenderJob, place: Place, started: float, handoff_seconds: float) -> StreamingResponse:
        """Starts the run now and answers with its frames: previews, images, then ``done`` (or ``error``).

        The run does not wait for the response to start streaming, so its place comes back even
        if the client is gone before the first byte; Starlette runs the background task after the
        stream ends or the client disconnects, which tells an abandoned run to stop.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[PartialImageFrame | ImageFrame | ProgressFrame | _RunEnded] = asyncio.Queue()
        cancel = threading.Event()

        def emit(frame: PartialImageFrame | ImageFrame | ProgressFrame) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, frame)

        run = asyncio.create_task(self._run(job, emit, cancel, place, queue))
        self._runs.add(run)
        run.add_done_callback(self._runs.discard)
        frames = self._frames(job, queue, cancel, started, handoff_seconds)
        return StreamingResponse(frames, media_type=RESULT_MEDIA_TYPE, background=BackgroundTask(cancel.set))

    async def _frames(
        self,
        job: RenderJob,
        queue: asyncio.Queue[PartialImageFrame | ImageFrame | ProgressFrame | _RunEnded],
        cancel: threading.Event,
        started: float,
        handoff_seconds: float,
    ) -> AsyncIterator[bytes]:
        total = job.denoising_steps * job.params.num_images
        progress = ProgressFrame(request_id=job.request_id, step=0, steps=total)
        last_sent = time.monotonic()
        try:
            while True:
                wait = max(0.0, last_sent + self.progress_interval - time.monotonic())
                try:
                    item: PartialImageFrame | ImageFrame | ProgressFrame | _RunEnded | None = await asyncio.wait_for(
                        queue.get(), wait
                    )
                except TimeoutError:
                    item = None  # nothing sent for a while: say where the run is
                if isinstance(item, _RunEnded):
                    yield encode_result(self._last_frame(job, item, started, handoff_seconds))
                    return
                if isinstance(item, ProgressFrame):
                    progress = item  # sent only when nothing else is
                    continue
                yield encode_result(progress if item is None else item)
                last_sent = time.monotonic()
        finally:
            cancel.set()
            self.metrics.request_seconds.observe(time.monotonic() - started)

    async def _run(
        self,
        job: RenderJob,
        emit: EmitResult,
        cancel: threading.Event,
        place: Place,
        queue: asyncio.Queue[PartialImageFrame | ImageFrame | ProgressFrame | _RunEnded],
    ) -> None:
        metrics = self.metrics
        timings, queue_seconds = None, 0.0
        try:
            timings, queue_seconds = await self.scheduler.run(job, emit, cancel)
            self._failures_in_a_row = 0
            log.info(
                "rendered %d image(s) of %dx%d, %d steps",
                job.params.num_images,
                job.params.width,
                job.params.height,
                job.params.num_inference_steps,
            )
        except RenderCancelled:
            metrics.pipeline_failures.labels("client_disconnected").inc()
        except Exception:
            log.exception("pipeline run for %s failed", job.request_id)
            metrics.pipeline_failures.labels("error").inc()
            self._failures_in_a_row += 1
            if self._failures_in_a_row >= self.max_consecutive_failures:
                self.fatal.trigger(f"the pipeline failed {self._failures_in_a_row} runs in a row")
        finally:
            place.release()
            job.trace.end(finished=timings is not None)
            queue.put_nowait(_RunEnded(timings, queue_seconds))

    @staticmethod
    def _last_frame(job: RenderJob, ended: _RunEnded, started: float, handoff_seconds: float) -> DoneFrame | ErrorFrame:
        if ended.timings is None:
            # No internals in the body; the log has the traceback.
            return ErrorFrame(
                request_id=job.request_id, status=500, code="pipeline_error", message="image generation failed"
            )
        timings = ended.timings
        return DoneFrame(
            request_id=job.request_id,
            timings={
                "handoff": handoff_seconds,
                "queue": ended.queue_seconds,
                "vae_encode": timings.vae_encode,
                "denoise": timings.denoise,
                "previews": timings.previews,
                "vae_decode": timings.vae_decode,
                "encode": timings.encode,
                "total": time.monotonic() - started,
            },
        )
