"""The handoff body on its own: frames in order, rows held or overlapped, engine failures, what close reports."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator

import pytest
import torch

from ar_service.engine.hidden_state_engine import EngineEvent, FinishedEvent, RowsEvent
from ar_service.handoff_body import ArTimings, BodyFrame, HandoffBody, coalesced
from ar_service.image_generation import EditHandoff
from ar_service.input_images import EditPixels, PicturePixels
from shared.diffusion import DiffusionParams
from shared.frames import OpenFrame, StreamName, StreamSpec
from shared.handoff_assembler import AssembledHandoff, HandoffReceiver
from shared.handoff_encoder import HandoffEncoder
from shared.row_recipe import RowRecipe
from tests.support.engine_runs import submitted
from tests.support.waiting import within

HIDDEN = 4


def encoder(uncond: bool = False) -> HandoffEncoder:
    streams: dict[StreamName, StreamSpec] = {"cond": StreamSpec(prompt_tokens=3, max_rows=3, prefix_tokens=1)}
    if uncond:
        streams["uncond"] = StreamSpec(prompt_tokens=2, max_rows=2, prefix_tokens=1)
    return HandoffEncoder(
        OpenFrame(
            request_id="req_body",
            model="m",
            dtype="float32",
            row_width=HIDDEN,
            rows=RowRecipe(layers=[1]),
            streams=streams,
            diffusion=DiffusionParams(width=16, height=16, num_inference_steps=2, guidance_scale=1.0, seed=0),
        )
    )


def finished(ids: list[int]) -> FinishedEvent:
    return FinishedEvent(
        token_ids=ids,
        prompt_tokens=len(ids) - 1,
        generated_token_ids=ids[-1:],
        row_count=len(ids) - 1,
        cached_tokens=0,
        cache_creation_tokens=0,
        submitted_at=1.0,
        first_token_at=2.0,
        finished_at=3.0,
    )


async def run_of(ids: list[int], pieces: list[int], fail: Exception | None = None) -> AsyncGenerator[EngineEvent, None]:
    start = 0
    rows = torch.arange(len(ids) - 1, dtype=torch.float32).unsqueeze(1).expand(-1, HIDDEN).contiguous()
    for count in pieces:
        yield RowsEvent(start=start, rows=rows[start : start + count], token_ids=ids[start : start + count])
        start += count
        await asyncio.sleep(0)
    if fail is not None:
        raise fail
    yield finished(ids)


Runs = dict[StreamName, AsyncGenerator[EngineEvent, None]]
Submitting = dict[StreamName, contextlib.AbstractAsyncContextManager[AsyncIterator[EngineEvent]]]


def body_of(runs: Runs, *, overlap: bool = True, received_at: float = 0.0) -> HandoffBody:
    submitting = {name: submitted(run) for name, run in runs.items()}
    return HandoffBody(encoder("uncond" in runs), submitting, overlap=overlap, received_at=received_at, pixels={})


async def collect(body: HandoffBody) -> list[BodyFrame]:
    async with body:
        return [frame async for frame in body]


def assemble(frames: list[BodyFrame]) -> AssembledHandoff:
    receiver = HandoffReceiver()
    for frame in frames:
        for buffer in frame.buffers:
            receiver.feed(buffer)
    return receiver.finish()


# Overlapped, each rows event went out before the next arrived; held, both go out as one frame.
@pytest.mark.parametrize(("overlap", "frame_count"), [(True, 4), (False, 3)])
def test_a_body_is_open_rows_close_and_assembles(overlap, frame_count):
    body = body_of({"cond": run_of([5, 6, 7, 8], [2, 1])}, overlap=overlap, received_at=0.5)
    frames = asyncio.run(collect(body))
    handoff = assemble(frames)
    cond = handoff.streams["cond"]
    assert cond.token_ids == [5, 6, 7, 8] and cond.rows[:, 0].tolist() == [0.0, 1.0, 2.0]
    assert len(frames) == frame_count
    assert [f.kind for f in frames] == ["open", *["rows"] * (frame_count - 2), "close"]
    timings = {"queue": 0.5, "ttft": 1.5, "decode": 1.0, "ar_total": 2.5, "negative_tail": 0.0}
    assert handoff.close.timings == timings
    report = frames[-1].engine
    assert report is not None and report.finished["cond"].token_ids == [5, 6, 7, 8] and report.last_row_at > 0
    assert all(f.engine is None for f in frames[:-1])


def test_an_edits_pictures_go_out_right_after_open_in_order_each_at_its_own_size_then_its_mask():
    pictures = (PicturePixels(4, 2, bytes(range(24))), PicturePixels(2, 3, bytes(range(100, 118))))
    edit = EditHandoff.of(None, EditPixels(pictures, mask=bytes([0, 255] * 4)))
    opened = encoder().open.model_copy(update={"edit": edit.spec})
    submitting: Submitting = {"cond": submitted(run_of([5, 6, 7, 8], [3]))}
    body = HandoffBody(HandoffEncoder(opened), submitting, overlap=True, received_at=0.0, pixels=edit.take_frames())
    frames = asyncio.run(collect(body))
    assert [f.kind for f in frames] == ["open", "pixels", "pixels", "pixels", "rows", "close"]
    assert edit.frames == {}  # given up to the body, which let each go as it was written
    handoff = assemble(frames)
    assert handoff.edit is not None and handoff.edit.strength is None
    assert [bytes(p.numpy().tobytes()) for p in handoff.edit.pictures] == [p.data for p in pictures]
    assert [tuple(p.shape) for p in handoff.edit.pictures] == [(2, 4, 3), (3, 2, 3)]
    assert handoff.edit.mask is not None and handoff.edit.mask.shape == (2, 4, 1)


def test_rows_that_arrive_while_frames_are_written_go_out_as_one_frame():
    handed_over = asyncio.Event()

    async def burst() -> AsyncGenerator[EngineEvent, None]:
        async for event in run_of([5, 6, 7, 8], [1, 1, 1]):
            yield event
        handed_over.set()

    async def scenario():
        body = body_of({"cond": burst()})
        async with body:
            await within(handed_over.wait(), "the engine handed over every row")  # before the body writes any
            return [frame async for frame in body]

    frames = asyncio.run(scenario())
    assert len(frames) == 3  # open, one rows frame, close
    cond = assemble(frames).streams["cond"]
    assert cond.token_ids == [5, 6, 7, 8] and cond.rows[:, 0].tolist() == [0.0, 1.0, 2.0]


def rows_event(start: int, count: int) -> RowsEvent:
    rows = torch.arange(start, start + count, dtype=torch.float32).unsqueeze(1).expand(-1, HIDDEN).contiguous()
    return RowsEvent(start=start, rows=rows, token_ids=list(range(100 + start, 100 + start + count)))


def test_contiguous_rows_of_each_stream_merge_across_the_other_streams_events_never_past_a_frame():
    row_bytes = HIDDEN * 4
    big = rows_event(0, 4)
    events: list[tuple[StreamName, RowsEvent]] = [
        ("cond", big),  # fills a frame of 4 rows on its own
        ("cond", rows_event(4, 1)),
        ("cond", rows_event(5, 2)),
        ("uncond", rows_event(0, 1)),  # another stream in between (CFG alternates every step)
        ("cond", rows_event(7, 1)),
        ("cond", rows_event(9, 1)),  # a gap
        ("cond", rows_event(10, 1)),
        ("cond", rows_event(11, 1)),
        ("cond", rows_event(12, 1)),  # the frame is full
    ]
    out = list(coalesced(events, max_bytes=4 * row_bytes))

    assert [(name, event.start, event.rows.shape[0]) for name, event in out] == [
        ("cond", 0, 4),
        ("cond", 4, 4),
        ("cond", 9, 4),
        ("uncond", 0, 1),
    ]
    assert out[0][1] is big  # passed through, not copied
    assert out[1][1].token_ids == [104, 105, 106, 107] and out[1][1].rows[:, 0].tolist() == [4.0, 5.0, 6.0, 7.0]


def test_both_streams_run_side_by_side_and_close_reports_both():
    runs: Runs = {
        "cond": run_of([5, 6, 7, 8], [3]),
        "uncond": run_of([9, 10, 11], [2]),
    }
    frames = asyncio.run(collect(body_of(runs)))
    report = frames[-1].engine
    assert report is not None and set(report.finished) == set(assemble(frames).streams) == {"cond", "uncond"}


def test_without_overlap_no_rows_leave_before_the_last_row():
    async def scenario():
        finished = asyncio.Event()

        async def run() -> AsyncGenerator[EngineEvent, None]:
            async for event in run_of([5, 6, 7, 8], [1, 1, 1]):
                if isinstance(event, FinishedEvent):
                    finished.set()
                yield event

        body = body_of({"cond": run()}, overlap=False)
        async with body:
            kinds = []
            async for frame in body:
                kinds.append(frame.kind)
                if frame.kind == "rows":
                    assert finished.is_set()  # rows are sent only after the engine finished
            return kinds

    assert asyncio.run(scenario()) == ["open", "rows", "close"]


def test_an_engine_failure_ends_the_body_with_it():
    body = body_of({"cond": run_of([5, 6, 7, 8], [1], fail=RuntimeError("engine died"))})
    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(collect(body))


def test_leaving_the_body_early_closes_the_engine_runs():
    started, closed = asyncio.Event(), asyncio.Event()

    async def endless() -> AsyncGenerator[EngineEvent, None]:
        started.set()
        try:
            await asyncio.Event().wait()  # busy for ever: only closing the run ends it
            if False:  # pragma: no cover - an async generator that never yields
                yield
        finally:
            closed.set()

    async def scenario():
        body = body_of({"cond": endless()})
        async with body:
            await anext(aiter(body))  # the open frame
            await started.wait()  # the engine run is under way; then the consumer goes away
        return closed.is_set()

    assert asyncio.run(scenario())


def test_the_tail_starts_when_the_last_rows_come_out_of_the_engine_not_when_they_are_sent():
    """All rows at once (encoder mode): writing them out is part of the handoff tail."""

    async def scenario() -> tuple[float, float]:
        engine_done = asyncio.Event()

        async def run() -> AsyncGenerator[EngineEvent, None]:
            async for event in run_of([5, 6, 7, 8], [1, 1, 1]):
                yield event
            engine_done.set()

        body = body_of({"cond": run()})
        async with body:
            await engine_done.wait()  # the engine is done with every row before the first is sent
            first_sent, last = None, None
            async for frame in body:
                first_sent, last = first_sent or time.perf_counter(), frame
                await asyncio.sleep(0.02)  # a slow socket
            assert first_sent is not None and last is not None and last.engine is not None
            return first_sent, last.engine.last_row_at

    first_sent, last_row_at = asyncio.run(scenario())
    assert last_row_at < first_sent


def test_with_cfg_the_timings_say_how_long_after_the_prompt_the_negative_prompts_run_finished():
    cond, uncond = finished([5, 6, 7]), finished([9, 10])
    later = dataclasses.replace(uncond, finished_at=cond.finished_at + 0.25)
    assert ArTimings.of(0.5, {"cond": cond, "uncond": later}).negative_tail == 0.25
    assert ArTimings.of(0.5, {"cond": cond, "uncond": uncond}).negative_tail == 0.0


def test_entering_the_body_submits_every_engine_run_before_the_first_frame_is_asked_for():
    entered: list[StreamName] = []

    @contextlib.asynccontextmanager
    async def recorded(name: StreamName, ids: list[int]) -> AsyncGenerator[AsyncIterator[EngineEvent], None]:
        entered.append(name)
        yield run_of(ids, [len(ids) - 1])

    async def scenario() -> list[StreamName]:
        runs: Submitting = {"cond": recorded("cond", [5, 6, 7]), "uncond": recorded("uncond", [9, 10])}
        async with HandoffBody(encoder(uncond=True), runs, overlap=True, received_at=0.0, pixels={}) as body:
            submitted_on_entry = list(entered)
            assert [frame.kind async for frame in body][-1] == "close"
        return submitted_on_entry

    assert asyncio.run(scenario()) == ["cond", "uncond"]


def test_a_run_that_fails_to_submit_ends_the_runs_already_submitted():
    left: list[StreamName] = []

    @contextlib.asynccontextmanager
    async def cond() -> AsyncGenerator[AsyncIterator[EngineEvent], None]:
        try:
            yield run_of([5, 6, 7], [2])
        finally:
            left.append("cond")

    @contextlib.asynccontextmanager
    async def uncond() -> AsyncGenerator[AsyncIterator[EngineEvent], None]:
        raise RuntimeError("the AR engine is not running")
        yield run_of([9, 10], [1])  # pragma: no cover - never submitted

    async def scenario() -> None:
        body = HandoffBody(
            encoder(uncond=True), {"cond": cond(), "uncond": uncond()}, overlap=True, received_at=0.0, pixels={}
        )
        async with body:
            pass  # pragma: no cover - entering fails

    with pytest.raises(RuntimeError, match="not running"):
        asyncio.run(scenario())
    assert left == ["cond"]
