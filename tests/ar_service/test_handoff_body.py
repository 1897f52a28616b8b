"""The handoff body on its own: frames in order, rows held or overlapped, engine failures, stats."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

import pytest
import torch

from ar_service.engine.hidden_state_engine import EngineEvent, FinishedEvent, RowsEvent
from ar_service.handoff_body import HandoffBody, coalesced
from shared.frames import DiffusionParams, OpenFrame, StreamName, StreamSpec
from shared.handoff_assembler import AssembledHandoff, HandoffReceiver
from shared.handoff_encoder import HandoffEncoder

HIDDEN = 4


def encoder(uncond: bool = False) -> HandoffEncoder:
    streams: dict[StreamName, StreamSpec] = {"cond": StreamSpec(prompt_tokens=3, max_rows=3, prefix_tokens=1)}
    if uncond:
        streams["uncond"] = StreamSpec(prompt_tokens=2, max_rows=2, prefix_tokens=1)
    return HandoffEncoder(
        OpenFrame(
            request_id="req_body",
            model="m",
            conditioning="qwen_image",
            dtype="float32",
            hidden_size=HIDDEN,
            layer=1,
            final_norm=True,
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


async def collect(body: HandoffBody) -> list[list]:
    async with body:
        return [frame async for frame in body]


def assemble(frames: list[list]) -> AssembledHandoff:
    receiver = HandoffReceiver()
    for frame in frames:
        for buffer in frame:
            receiver.feed(buffer)
    return receiver.finish()


# Overlapped, each rows event went out before the next arrived; held, both go out as one frame.
@pytest.mark.parametrize(("overlap", "frame_count"), [(True, 4), (False, 3)])
def test_a_body_is_open_rows_close_and_assembles(overlap, frame_count):
    body = HandoffBody(encoder(), {"cond": run_of([5, 6, 7, 8], [2, 1])}, overlap=overlap, received_at=0.5)
    frames = asyncio.run(collect(body))
    cond = assemble(frames).streams["cond"]
    assert cond.token_ids == [5, 6, 7, 8] and cond.rows[:, 0].tolist() == [0.0, 1.0, 2.0]
    assert body.stats.frames_sent == len(frames) == frame_count and body.stats.bytes_sent == sum(
        memoryview(b).nbytes for f in frames for b in f
    )
    assert body.stats.last_row_at is not None
    assert body.ar_timings().as_dict() == {"queue": 0.5, "ttft": 1.5, "decode": 1.0, "ar_total": 2.5}


def test_rows_that_arrive_while_frames_are_written_go_out_as_one_frame():
    async def burst() -> AsyncGenerator[EngineEvent, None]:
        async for event in run_of([5, 6, 7, 8], [1, 1, 1]):
            yield event

    async def scenario():
        body = HandoffBody(encoder(), {"cond": burst()}, overlap=True, received_at=0.0)
        async with body:
            await asyncio.sleep(0.01)  # the engine hands over every row before the body writes any
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
    runs: dict[StreamName, AsyncGenerator[EngineEvent, None]] = {
        "cond": run_of([5, 6, 7, 8], [3]),
        "uncond": run_of([9, 10, 11], [2]),
    }
    body = HandoffBody(encoder(uncond=True), runs, overlap=True, received_at=0.0)
    frames = asyncio.run(collect(body))
    assert set(body.finished) == set(assemble(frames).streams) == {"cond", "uncond"}


def test_without_overlap_no_rows_leave_before_the_last_row():
    async def scenario():
        body = HandoffBody(encoder(), {"cond": run_of([5, 6, 7, 8], [1, 1, 1])}, overlap=False, received_at=0.0)
        async with body:
            iterator = aiter(body)
            first = await anext(iterator)
            assert body.stats.last_row_at is None
            second = await anext(iterator)
            assert body.stats.last_row_at is not None  # rows are sent only after the engine finished
            return first, second

    first, second = asyncio.run(scenario())
    assert first and second


def test_an_engine_failure_ends_the_body_with_it():
    body = HandoffBody(
        encoder(), {"cond": run_of([5, 6, 7, 8], [1], fail=RuntimeError("engine died"))}, overlap=True, received_at=0
    )
    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(collect(body))


def test_leaving_the_body_early_closes_the_engine_runs():
    started, closed = asyncio.Event(), asyncio.Event()

    async def endless() -> AsyncGenerator[EngineEvent, None]:
        started.set()
        try:
            while True:
                await asyncio.sleep(0.01)
                if False:  # pragma: no cover - an async generator that never yields
                    yield
        finally:
            closed.set()

    async def scenario():
        body = HandoffBody(encoder(), {"cond": endless()}, overlap=True, received_at=0.0)
        async with body:
            await anext(aiter(body))  # the open frame
            await started.wait()  # the engine run is under way; then the consumer goes away
        return closed.is_set()

    assert asyncio.run(scenario())


def test_the_tail_starts_when_the_last_rows_come_out_of_the_engine_not_when_they_are_sent():
    """All rows at once (encoder mode): writing them out is part of the handoff tail."""

    async def scenario() -> tuple[float, float | None]:
        engine_done = asyncio.Event()

        async def run() -> AsyncGenerator[EngineEvent, None]:
            async for event in run_of([5, 6, 7, 8], [1, 1, 1]):
                yield event
            engine_done.set()

        body = HandoffBody(encoder(), {"cond": run()}, overlap=True, received_at=0.0)
        async with body:
            await engine_done.wait()  # the engine is done with every row before the first is sent
            first_sent = None
            async for _frame in body:
                first_sent = first_sent or time.perf_counter()
                await asyncio.sleep(0.02)  # a slow socket
            assert first_sent is not None
            return first_sent, body.stats.last_row_at

    first_sent, last_row_at = asyncio.run(scenario())
    assert last_row_at is not None and last_row_at < first_sent
