"""The rows of recent negative prompts, kept so that a repeat needs no engine run.

With CFG the handoff waits for the negative prompt's rows as well as the prompt's. The two are sent to
the engine together, but vLLM's engine core starts a step as soon as the first arrives, so the negative
prompt joins only the next step, after the prompt's prefill (what that costs a request:
benchmarks/results/peer_compare.md, serving overhead). Most requests share their negative
prompt (the default ``" "``), and its run only encodes (one step, greedy, no sampling), so its rows are
a function of its token ids: the first run's events are kept and replayed for a repeat.

Kept per (cache salt, token ids, pictures): the salt carries the tenant, so one tenant's negative prompts are never
another's hits (the same rule as the prefix cache). An edit model reads the negative prompt with the edit's pictures,
so they are part of the key, by a digest of their pixels: editing one picture again with another instruction replays
its negative rows. Bounded by bytes, least recently used first out; an
entry is kept only once its run finished. A replay reports every prompt token as cached and its times as
the replay's own.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace

import PIL.Image

from ar_service.engine.hidden_state_engine import (
    EngineEvent,
    EngineRequest,
    FinishedEvent,
    HiddenStateEngine,
    RowsEvent,
)

_Key = tuple[str | None, tuple[int, ...], tuple[bytes, ...]]


class NegativeRows:
    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._kept: OrderedDict[_Key, tuple[list[RowsEvent], FinishedEvent, int]] = OrderedDict()
        self._bytes = 0

    @contextlib.asynccontextmanager
    async def submitted(
        self, engine: HiddenStateEngine, request: EngineRequest
    ) -> AsyncGenerator[AsyncIterator[EngineEvent], None]:
        """``engine.submitted(request)``: replayed, with no engine run, when this negative prompt's run was
        kept; else the engine's, kept when the run finishes."""
        if request.max_new_tokens != 1 or request.temperature != 0.0:
            raise ValueError("only a negative prompt's encode-only run is kept")
        key = (request.cache_salt, tuple(request.prompt_token_ids), tuple(map(_digest, request.pictures)))
        kept = self._kept.get(key)
        if kept is not None:
            self._kept.move_to_end(key)
            yield self._replayed(*kept[:2])
            return
        async with engine.submitted(request) as events:
            yield self._keeping(key, events)

    async def _replayed(self, rows: list[RowsEvent], finished: FinishedEvent) -> AsyncGenerator[EngineEvent, None]:
        for kept_rows in rows:
            yield kept_rows
        now = time.perf_counter()
        yield replace(
            finished,
            cached_tokens=finished.prompt_tokens,
            cache_creation_tokens=0,
            pictures_encoded=0,
            submitted_at=now,
            first_token_at=now,
            finished_at=now,
        )

    async def _keeping(self, key: _Key, events: AsyncIterator[EngineEvent]) -> AsyncGenerator[EngineEvent, None]:
        seen: list[RowsEvent] = []
        async for event in events:
            if isinstance(event, RowsEvent):
                seen.append(event)
            else:
                self._keep(key, seen, event)
            yield event

    def _keep(self, key: _Key, rows: list[RowsEvent], finished: FinishedEvent) -> None:
        size = sum(event.rows.nelement() * event.rows.element_size() for event in rows)
        if size > self._max_bytes or key in self._kept:
            return
        self._kept[key] = (rows, finished, size)
        self._bytes += size
        while self._bytes > self._max_bytes:
            _, (_, _, evicted) = self._kept.popitem(last=False)
            self._bytes -= evicted


def _digest(picture: PIL.Image.Image) -> bytes:
    """The picture's size, mode and pixels, hashed."""
    return hashlib.blake2b(f"{picture.size} {picture.mode}".encode() + picture.tobytes(), digest_size=16).digest()
