"""Negative prompts' rows: a repeat is replayed without an engine run, per tenant, within a byte bound;
only a finished run is kept."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from typing import cast

import PIL.Image
import pytest
import torch

from ar_service.engine.hidden_state_engine import (
    EngineEvent,
    EngineRequest,
    FinishedEvent,
    HiddenStateEngine,
    RowsEvent,
)
from ar_service.negative_rows import NegativeRows
from tests.support.engine_runs import submitted

HIDDEN = 4


class CountingEngine:
    """Runs an encode-only request: one rows event per prompt row, then its finished event."""

    def __init__(self, fail: bool = False) -> None:
        self.runs = 0
        self.fail = fail

    def submitted(self, request: EngineRequest) -> AbstractAsyncContextManager[AsyncIterator[EngineEvent]]:
        self.runs += 1
        return submitted(self._run(request))

    async def _run(self, request: EngineRequest) -> AsyncGenerator[EngineEvent, None]:
        ids = request.prompt_token_ids
        rows = torch.arange(len(ids) * HIDDEN, dtype=torch.float32).reshape(len(ids), HIDDEN) + self.runs
        yield RowsEvent(start=0, rows=rows[:-1], token_ids=ids[:-1])
        if self.fail:
            raise RuntimeError("the engine died")
        yield FinishedEvent(
            token_ids=[*ids, 7],
            prompt_tokens=len(ids),
            generated_token_ids=[7],
            row_count=len(ids),
            cached_tokens=0,
            cache_creation_tokens=0,
            submitted_at=1.0,
            first_token_at=2.0,
            finished_at=2.0,
        )


def negative(ids: list[int], salt: str | None = "tenant-a") -> EngineRequest:
    return EngineRequest(engine_request_id=f"r{ids}", prompt_token_ids=ids, max_new_tokens=1, cache_salt=salt)


def events(kept: NegativeRows, engine: CountingEngine, request: EngineRequest) -> list[EngineEvent]:
    async def collect() -> list[EngineEvent]:
        async with kept.submitted(cast(HiddenStateEngine, engine), request) as run:
            return [e async for e in run]

    return asyncio.run(collect())


def test_a_repeated_negative_prompt_is_replayed_without_an_engine_run_every_token_cached():
    kept, engine = NegativeRows(1 << 20), CountingEngine()
    first = events(kept, engine, negative([1, 2, 3]))
    again = events(kept, engine, negative([1, 2, 3]))
    assert engine.runs == 1
    assert isinstance(first[0], RowsEvent) and isinstance(again[0], RowsEvent)
    assert torch.equal(first[0].rows, again[0].rows)
    done = again[-1]
    assert isinstance(done, FinishedEvent)
    assert (done.cached_tokens, done.cache_creation_tokens, done.token_ids) == (3, 0, [1, 2, 3, 7])
    assert done.submitted_at == done.finished_at > 2.0  # the replay's own time


def test_another_tenant_or_another_prompt_runs_the_engine():
    kept, engine = NegativeRows(1 << 20), CountingEngine()
    events(kept, engine, negative([1, 2, 3]))
    events(kept, engine, negative([1, 2, 3], salt="tenant-b"))
    events(kept, engine, negative([1, 2, 4]))
    assert engine.runs == 3


def test_a_run_that_fails_is_not_kept():
    kept, failing = NegativeRows(1 << 20), CountingEngine(fail=True)
    with pytest.raises(RuntimeError):
        events(kept, failing, negative([1, 2, 3]))
    failing.fail = False
    events(kept, failing, negative([1, 2, 3]))
    assert failing.runs == 2


def test_the_least_recently_used_go_first_and_nothing_over_the_bound_is_kept():
    one_entry = 2 * HIDDEN * 4  # two rows of float32
    kept, engine = NegativeRows(2 * one_entry), CountingEngine()
    for ids in ([1, 2, 3], [4, 5, 6], [1, 2, 3], [7, 8, 9]):  # the second is the least recently used
        events(kept, engine, negative(ids))
    assert engine.runs == 3
    events(kept, engine, negative([1, 2, 3]))  # still kept
    events(kept, engine, negative([4, 5, 6]))  # evicted
    assert engine.runs == 4
    just_under, small_engine = NegativeRows(one_entry - 1), CountingEngine()
    events(just_under, small_engine, negative([1, 2, 3]))
    events(just_under, small_engine, negative([1, 2, 3]))
    assert small_engine.runs == 2
    exactly, exact_engine = NegativeRows(one_entry), CountingEngine()
    events(exactly, exact_engine, negative([1, 2, 3]))
    events(exactly, exact_engine, negative([1, 2, 3]))
    assert exact_engine.runs == 1


def test_only_an_encode_only_run_is_kept():
    with pytest.raises(ValueError):
        events(NegativeRows(1 << 20), CountingEngine(), EngineRequest("r", [1, 2], max_new_tokens=4))


def test_an_edits_negative_prompt_is_replayed_for_the_same_picture_and_run_again_for_another():
    kept, engine = NegativeRows(1 << 20), CountingEngine()
    picture, other = (PIL.Image.new("RGB", (32, 32), colour) for colour in ("red", "blue"))

    def reading(image: PIL.Image.Image) -> EngineRequest:
        return replace(negative([1, 2, 3]), pictures=(image,))

    events(kept, engine, reading(picture))
    events(kept, engine, reading(picture.copy()))
    assert engine.runs == 1
    events(kept, engine, reading(other))
    events(kept, engine, negative([1, 2, 3]))
    assert engine.runs == 3
