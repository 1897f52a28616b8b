"""The answer stream: frame order, errors after the start, and what a disconnect does to a run."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from typing import TypedDict

import httpx
import pytest
import torch
from prometheus_client import CollectorRegistry

from dit_service.admission import AdmissionControl
from dit_service.conditioning import Conditioning
from dit_service.metrics import DitMetrics
from dit_service.render_job import RenderCancelled, RenderItem, RenderJob, RenderOutcome, RenderTimings
from dit_service.render_scheduler import RenderScheduler
from dit_service.result_stream import ResultStream
from services.errors import ApiError
from services.fatal import Fatal
from services.heap import IdleRelease, return_free_pages_in_thread
from shared.diffusion import OutputFormat
from shared.result_frames import RESULT_MEDIA_TYPE, ImageFrame, PartialImageFrame, ResultFrame, ResultReader
from tests.dit_service.handoff_requests import (
    complete_handoff,
    handoff_headers,
    hidden_rows,
    metric,
    params,
    post_handoff,
)
from tests.support.waiting import HANG_GUARD, until, wait_for

JOB = RenderJob("req_x", Conditioning(torch.zeros(1, 1, 4), torch.ones(1, 1, dtype=torch.long)), params())


class ImageFields(TypedDict):
    """What a preview and the final image of JOB's first image share."""

    request_id: str
    image_index: int
    output_format: OutputFormat


FRAME: ImageFields = {"request_id": "req_x", "image_index": 0, "output_format": "png"}


def places(queue_size: int) -> AdmissionControl:
    return AdmissionControl(
        max_handoffs=1, max_runs=1, queue_size=queue_size, retry_after_seconds=1, reservation_seconds=30
    )


def result_stream(
    runner,
    admission: AdmissionControl,
    metrics: DitMetrics | None = None,
    fatal: Fatal | None = None,
    progress_interval: float = 60.0,
) -> ResultStream:
    metrics = metrics or DitMetrics(CollectorRegistry())
    # Batching off: the scheduler hands each job to ``runner`` alone.
    scheduler = RenderScheduler(
        runner,
        admission.run_slots,
        metrics,
        max_batch_size=1,
        window=0.0,
        idle=IdleRelease(0, return_free_pages_in_thread),
    )
    return ResultStream(
        scheduler,
        metrics,
        fatal or Fatal(),
        progress_interval=progress_interval,
        max_consecutive_failures=2,
    )


class ScriptedRunner:
    """Stands in for the Renderer: emits a preview and an image, or fails, or waits to be cancelled (then
    finishes the step in progress when the test ends it), or takes a long silent step."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.finished = threading.Event()
        self.started = threading.Event()
        self.step_ends = threading.Event()

    def render(self, items: list[RenderItem]) -> list[RenderOutcome]:
        [item] = items
        return [self._run(item.emit, item.cancel)]

    def _run(self, emit, cancel) -> RenderOutcome:
        try:
            self.started.set()
            emit(PartialImageFrame(**FRAME, partial_image_index=0, step=1, data=b"p"))
            if self.behaviour == "fail":
                raise RuntimeError("secret internals")
            if self.behaviour == "wait_for_cancel":
                assert cancel.wait(HANG_GUARD)
                assert self.step_ends.wait(HANG_GUARD)  # the step in progress: the run outlives its consumer
                return RenderCancelled()
            if self.behaviour == "silent_step":
                time.sleep(0.5)
            emit(ImageFrame(**FRAME, seed=0, width=32, height=32, data=b"i"))
            return RenderTimings(denoise=1.0)
        finally:
            self.finished.set()


def collect(behaviour: str, fatal: Fatal | None = None, progress_interval: float = 60.0):
    async def run():
        admission = AdmissionControl(
            max_handoffs=1, max_runs=1, queue_size=0, retry_after_seconds=1, reservation_seconds=30
        )
        stream = result_stream(ScriptedRunner(behaviour), admission, fatal=fatal, progress_interval=progress_interval)
        response = stream.respond(JOB, admission.place(None), time.monotonic(), handoff_seconds=0.5)
        assert response.media_type == RESULT_MEDIA_TYPE
        reader = ResultReader()
        frames: list[ResultFrame] = []
        async for chunk in response.body_iterator:
            assert isinstance(chunk, bytes)
            frames += reader.feed(chunk)
        return frames

    return asyncio.run(run())


def test_frames_come_in_order_and_end_with_done():
    frames = collect("succeed")
    assert [f.kind for f in frames] == ["partial_image", "image", "done"]
    timings = frames[-1].timings
    assert timings["denoise"] == 1.0 and timings["handoff"] == 0.5
    assert set(timings) >= {"queue", "denoise", "vae_decode", "encode", "total"}


def test_failure_after_the_start_ends_with_an_error_frame_without_internals():
    frames = collect("fail")
    assert [f.kind for f in frames] == ["partial_image", "error"]
    assert frames[-1].status == 500 and frames[-1].code == "pipeline_error"
    assert "secret" not in frames[-1].message


def test_a_silent_stretch_is_filled_with_progress_so_silence_means_frozen():
    frames = collect("silent_step", progress_interval=0.1)
    kinds = [f.kind for f in frames]
    assert kinds[0] == "partial_image" and kinds[-2:] == ["image", "done"]
    assert 2 <= kinds.count("progress") <= 6  # about one per 0.1 s of a 0.5 s silent step


def test_consecutive_failures_of_one_stream_trigger_fatal():
    async def run():
        fatal = Fatal()
        admission = AdmissionControl(
            max_handoffs=1, max_runs=1, queue_size=2, retry_after_seconds=1, reservation_seconds=30
        )
        stream = result_stream(ScriptedRunner("fail"), admission, fatal=fatal)
        for expected in (None, "the pipeline failed 2 runs in a row"):
            response = stream.respond(JOB, admission.place(None), 0.0, 0.0)
            async for _ in response.body_iterator:
                pass
            assert fatal.reason == expected

    asyncio.run(run())


async def handed_back(admission: AdmissionControl) -> None:
    """Once the run has ended, its task gives back its place and run slot."""
    await until(lambda: admission.taken == 0 and not admission.run_slots.locked(), what="place and slot back")


def test_a_consumer_that_goes_away_stops_the_run_and_capacity_returns_only_when_it_has():
    async def run():
        admission = AdmissionControl(
            max_handoffs=1, max_runs=1, queue_size=0, retry_after_seconds=1, reservation_seconds=30
        )
        runner = ScriptedRunner("wait_for_cancel")
        metrics = DitMetrics(CollectorRegistry())
        response = result_stream(runner, admission, metrics).respond(JOB, admission.place(None), 0.0, 0.0)
        frames = response.body_iterator
        assert isinstance(frames, AsyncGenerator)
        await anext(frames)  # the preview: the run is under way
        await frames.aclose()  # what a disconnect does to the response
        assert not runner.finished.is_set()
        with pytest.raises(ApiError, match="every place is taken"):
            admission.place(None)  # still held by the running thread
        runner.step_ends.set()
        await handed_back(admission)
        assert runner.finished.is_set()
        admission.place(None).release()
        assert not admission.run_slots.locked()
        assert metrics.pipeline_failures.labels("client_disconnected")._value.get() == 1

    asyncio.run(run())


def test_a_response_that_never_streams_still_stops_its_run_and_gives_back_its_place():
    async def run():
        admission = AdmissionControl(
            max_handoffs=1, max_runs=1, queue_size=0, retry_after_seconds=1, reservation_seconds=30
        )
        runner = ScriptedRunner("wait_for_cancel")
        response = result_stream(runner, admission).respond(JOB, admission.place(None), 0.0, 0.0)
        await asyncio.to_thread(runner.started.wait, 10)
        assert response.background is not None
        await response.background()  # what Starlette runs when the client is gone before the first byte
        runner.step_ends.set()
        await handed_back(admission)
        admission.place(None).release()

    asyncio.run(run())


# --- on a live server -----------------------------------------------------------------------------


@pytest.mark.slow
def test_same_handoff_same_seed_gives_the_same_bytes(dit_server):
    body = complete_handoff(hidden_rows(10, seed=1), diffusion=params(seed=42, num_inference_steps=3))
    first, second = post_handoff(dit_server.url, body), post_handoff(dit_server.url, body)
    assert first.images[0].data == second.images[0].data


@pytest.mark.slow
def test_different_conditioning_changes_the_image(dit_server):
    one = post_handoff(dit_server.url, complete_handoff(hidden_rows(10, seed=1)))
    other = post_handoff(dit_server.url, complete_handoff(hidden_rows(10, seed=2)))
    assert one.images[0].data != other.images[0].data


@pytest.mark.slow
def test_partial_images_arrive_before_the_final_image(dit_server):
    diffusion = params(num_inference_steps=4, partial_images=2)
    answer = post_handoff(dit_server.url, complete_handoff(hidden_rows(10), diffusion=diffusion))
    assert answer.kinds == ["partial_image", "partial_image", "image", "done"]


@pytest.mark.slow
@pytest.mark.parametrize("output_format", ["jpeg", "webp"])
def test_lossy_formats_honour_output_compression(dit_server, output_format):
    def size(compression: int) -> int:
        diffusion = params(width=64, height=64, output_format=output_format, output_compression=compression)
        answer = post_handoff(dit_server.url, complete_handoff(hidden_rows(10), diffusion=diffusion))
        assert answer.images[0].output_format == output_format
        return len(answer.images[0].data)

    assert size(10) < size(95)


@pytest.mark.slow
def test_concurrent_requests_render_what_sequential_ones_do(dit_server):
    bodies = [
        complete_handoff(hidden_rows(10, seed=s), diffusion=params(seed=s, num_inference_steps=6, num_images=2))
        for s in (1, 2)
    ]
    sequential = [post_handoff(dit_server.url, body) for body in bodies]
    with ThreadPoolExecutor(2) as pool:
        concurrent = list(pool.map(lambda body: post_handoff(dit_server.url, body), bodies))
    for alone, together in zip(sequential, concurrent, strict=True):
        assert [i.data for i in alone.images] == [i.data for i in together.images]


@pytest.mark.slow
def test_disconnect_mid_run_interrupts_it_and_frees_the_pipeline(narrow_server):
    url = narrow_server.url
    images_before = metric(url, "ardit_dit_images_total", format="png")
    diffusion = params(width=128, height=128, num_inference_steps=400, partial_images=3)
    body = complete_handoff(hidden_rows(10), diffusion=diffusion)
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{url}/v1/handoff", content=iter(body), headers=handoff_headers()) as response,
    ):
        assert response.status_code == 200
        # Held in a variable: a dropped iterator would close the connection right away.
        chunks, reader = response.iter_bytes(), ResultReader()
        while not any(f.kind == "partial_image" for f in reader.feed(next(chunks))):
            pass
        assert metric(url, "ardit_dit_pipeline_runs_in_flight") == 1
        # The only run slot is taken and nothing may queue: refused up front.
        busy = post_handoff(url, complete_handoff(hidden_rows(10)))
        assert busy.status == 429 and busy.refusal["code"] == "dit_full"
        assert busy.headers["retry-after"]
    wait_for(
        lambda: (
            not metric(url, "ardit_dit_pipeline_runs_in_flight")
            and metric(url, "ardit_dit_pipeline_failures_total", reason="client_disconnected")
        ),
        10,
        "the run stopped",
    )
    assert metric(url, "ardit_dit_images_total", format="png") == images_before
    assert post_handoff(url, complete_handoff(hidden_rows(10))).status == 200
