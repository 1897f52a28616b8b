"""One request's handoff body: ``open``, rows as the engine produces them, ``close``.

A ``HandoffBody`` owns everything the body is made of: an edit's pictures (and mask), sent right
after ``open``; the engine runs of the request's streams (``cond``, and ``uncond`` with CFG)
running side by side, and the rows held back when the handoff is not overlapped with decoding.
Whoever sends it only iterates it: each ``BodyFrame`` is one frame's wire buffers, and the last,
``close``, carries what the engine runs reported (their finished events, and when the engine
handed over its last rows), so the sender's report needs nothing read back from the body.

Rows become frames as soon as they arrive (``overlap``), so the transfer hides behind prefill
and decoding; without ``overlap`` they are held and sent after the AR's last row.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

import torch

from ar_service.engine.hidden_state_engine import EngineEvent, FinishedEvent, RowsEvent
from shared.frame_types import Buffer
from shared.frames import PixelsPlace, StreamName
from shared.handoff_encoder import HandoffEncoder


@dataclass(frozen=True)
class EngineReport:
    """What the engine runs reported, carried by the ``close`` frame."""

    finished: Mapping[StreamName, FinishedEvent]
    last_row_at: float  # perf_counter when the engine handed over its last rows


@dataclass(frozen=True)
class BodyFrame:
    kind: Literal["open", "pixels", "rows", "close"]
    buffers: list[Buffer]
    engine: EngineReport | None = None  # with ``close`` only

    @property
    def nbytes(self) -> int:
        return sum(memoryview(b).nbytes for b in self.buffers)


@dataclass(frozen=True)
class ArTimings:
    """Seconds from the HTTP request's arrival, from the ``cond`` stream's finished event; and, with
    CFG, how long after it the negative prompt's run finished (the handoff cannot close before both:
    the engine picks up a request that arrives during another's prefill only at its next step)."""

    queue: float
    ttft: float
    decode: float
    ar_total: float
    negative_tail: float

    @classmethod
    def of(cls, received_at: float, finished: Mapping[StreamName, FinishedEvent]) -> ArTimings:
        cond = finished["cond"]
        last = max(f.finished_at for f in finished.values())
        return cls(
            queue=max(0.0, cond.submitted_at - received_at),
            ttft=max(0.0, cond.first_token_at - received_at),
            decode=max(0.0, cond.finished_at - cond.first_token_at),
            ar_total=max(0.0, cond.finished_at - received_at),
            negative_tail=max(0.0, last - cond.finished_at),
        )

    def as_dict(self) -> dict[str, float]:
        return {
            "queue": self.queue,
            "ttft": self.ttft,
            "decode": self.decode,
            "ar_total": self.ar_total,
            "negative_tail": self.negative_tail,
        }


class HandoffBody:
    """Use as ``async with``: entering submits the engine runs, leaving stops those still going. It is
    sent once: an edit's pixels are let go of as their frames go out."""

    def __init__(
        self,
        encoder: HandoffEncoder,
        runs: Mapping[StreamName, AbstractAsyncContextManager[AsyncIterator[EngineEvent]]],
        *,
        overlap: bool,
        received_at: float,
        pixels: Mapping[PixelsPlace, bytes],
    ) -> None:
        self._encoder = encoder
        self._pixels = dict(pixels)
        self._runs = runs
        self._overlap = overlap
        self._received_at = received_at
        # Each event with the perf_counter it came out of the engine at.
        self._events: asyncio.Queue[tuple[StreamName, EngineEvent | BaseException, float]] = asyncio.Queue()
        self._pumps: list[asyncio.Task[None]] = []
        self._submitted = contextlib.AsyncExitStack()

    async def __aenter__(self) -> HandoffBody:
        """Submits the engine runs and returns once the engine holds them: the sender's set-up (the
        connection, the open frame) then overlaps the engine's work instead of delaying it."""
        async with contextlib.AsyncExitStack() as submitted:
            streams = {name: await submitted.enter_async_context(run) for name, run in self._runs.items()}
            self._submitted = submitted.pop_all()
        self._pumps = [
            asyncio.create_task(self._pump(name, events), name=f"pump-{name}") for name, events in streams.items()
        ]
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        # Aborts the engine runs still going. An abort that fails (the engine died) must not replace what
        # ended the body: the engine's death is watched and answered on its own.
        with contextlib.suppress(Exception):
            await self._submitted.aclose()

    async def __aiter__(self) -> AsyncIterator[BodyFrame]:
        encoder = self._encoder
        yield BodyFrame("open", encoder.open_frame())
        for role, index in list(self._pixels):
            yield BodyFrame("pixels", encoder.pixels(role, index, self._pixels.pop((role, index))))
        held: list[tuple[StreamName, RowsEvent]] = []
        finished: dict[StreamName, FinishedEvent] = {}
        last_row_at = 0.0
        while len(finished) < len(self._runs):
            # Everything the engine handed over while the last frames were being written goes out
            # together: a slow reader gets fewer, larger frames instead of one per decode step.
            arrived = [await self._events.get()]
            while not self._events.empty():
                arrived.append(self._events.get_nowait())
            rows: list[tuple[StreamName, RowsEvent]] = []
            for name, event, arrived_at in arrived:
                if isinstance(event, BaseException):
                    raise event
                last_row_at = max(last_row_at, arrived_at)
                if isinstance(event, FinishedEvent):
                    finished[name] = event
                else:
                    rows.append((name, event))
            if self._overlap:
                for name, event in coalesced(rows, encoder.max_frame_payload):
                    for frame in encoder.row_frames(name, event.start, event.token_ids, event.rows):
                        yield BodyFrame("rows", frame)
            else:
                held.extend(rows)
        for name, event in coalesced(held, encoder.max_frame_payload):
            for frame in encoder.row_frames(name, event.start, event.token_ids, event.rows):
                yield BodyFrame("rows", frame)
        close = encoder.close(
            token_ids={name: f.token_ids for name, f in finished.items()},
            answer_start_index={name: f.prompt_tokens for name, f in finished.items()},
            cached_tokens=sum(f.cached_tokens for f in finished.values()),
            cache_creation_tokens=sum(f.cache_creation_tokens for f in finished.values()),
            timings=ArTimings.of(self._received_at, finished).as_dict(),
        )
        # The handoff tail starts when the engine was done with its last rows, whether they already
        # went out, are still being written (all rows at once: encoder mode), or were held.
        yield BodyFrame("close", close, EngineReport(finished, last_row_at))

    async def _pump(self, name: StreamName, events: AsyncIterator[EngineEvent]) -> None:
        try:
            async for event in events:
                await self._events.put((name, event, time.perf_counter()))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the body, which fails the handoff with it
            await self._events.put((name, exc, time.perf_counter()))


def coalesced(events: list[tuple[StreamName, RowsEvent]], max_bytes: int) -> Iterator[tuple[StreamName, RowsEvent]]:
    """``events`` by stream (each stream's own order kept), each run of contiguous rows merged into one event of
    at most ``max_bytes`` (one frame's payload). With CFG the two streams alternate step by step, so merging only
    neighbours would merge nothing; the receiver needs order within a stream only. An event that fills a frame on
    its own passes through uncopied."""
    by_stream: dict[StreamName, list[RowsEvent]] = {}
    for name, event in events:
        by_stream.setdefault(name, []).append(event)
    for name, stream_events in by_stream.items():
        for event in _contiguous_runs(stream_events, max_bytes):
            yield name, event


def _contiguous_runs(events: list[RowsEvent], max_bytes: int) -> Iterator[RowsEvent]:
    group: list[RowsEvent] = []
    group_bytes = 0
    for event in events:
        size = event.rows.nbytes
        follows = bool(group) and event.start == group[-1].start + group[-1].rows.shape[0]
        if group and not (follows and group_bytes + size <= max_bytes):
            yield _merged(group)
            group, group_bytes = [], 0
        group.append(event)
        group_bytes += size
    if group:
        yield _merged(group)


def _merged(group: list[RowsEvent]) -> RowsEvent:
    if len(group) == 1:
        return group[0]
    rows = torch.cat([event.rows for event in group])
    return RowsEvent(group[0].start, rows, [i for event in group for i in event.token_ids])
