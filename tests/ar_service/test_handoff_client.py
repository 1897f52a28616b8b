"""The AR's side of one handoff exchange on its own, against stand-in DiTs on loopback ports: how each way
a DiT can fail or fall silent ends the exchange, and that a failure of the engine stays the engine's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

import aiohttp
import pytest
import torch
from aiohttp import web

from ar_service.engine.hidden_state_engine import EngineEvent, RowsEvent
from ar_service.engine.row_channel import RowQueueOverflow
from ar_service.handoff_body import HandoffBody
from ar_service.handoff_client import DitUnavailable, DitUnreachable, HandoffClient
from shared.frames import StreamSpec
from shared.handoff_encoder import HandoffEncoder
from shared.result_frames import DoneFrame, encode_result
from tests.ar_service.test_handoff_body import encoder, finished, run_of
from tests.support.engine_runs import submitted
from tests.support.fake_dit import fake_dit
from tests.support.ports import free_port

STALL = 0.5  # seconds
DEADLINE = 60.0  # the whole exchange's: an exchange ended before it was ended by the stall bound


class ExchangeEnded(Exception):
    """The exchange failed after ``seconds``; the failure is the ``__cause__``."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"after {seconds:.2f} s")
        self.seconds = seconds


async def exchange(body: HandoffBody, dit_reads: bool | None = None) -> float:
    """Seconds the exchange of ``body`` took with a stand-in DiT that answers ``done`` once it has read the
    body; or, with ``dit_reads`` said, one that reads the body (or not) and then never answers."""
    over = asyncio.Event()

    async def answer(request: web.Request) -> web.Response:
        if dit_reads is not False:
            await request.read()
        if dit_reads is None:
            return web.Response(body=encode_result(DoneFrame(request_id="req_body")))
        await over.wait()  # until the exchange is over, so that the stand-in can be stopped
        return web.Response()

    timeout = aiohttp.ClientTimeout(total=None, sock_read=STALL)
    async with fake_dit(answer) as dit, aiohttp.ClientSession(timeout=timeout) as session:
        client = HandoffClient(session, dit.url, "t", deadline_seconds=DEADLINE, stall_seconds=STALL)
        started = time.monotonic()
        try:
            async with body:
                await client.exchange("req_body", "r-1", body)
        except Exception as exc:
            raise ExchangeEnded(time.monotonic() - started) from exc
        finally:
            over.set()
        return time.monotonic() - started


def body(run: AsyncGenerator[EngineEvent, None]) -> HandoffBody:
    return HandoffBody(encoder(), {"cond": submitted(run)}, overlap=True, received_at=0.0, pixels={})


def wide_body(rows: int, width: int) -> HandoffBody:
    """One stream of ``rows`` rows of ``width`` floats, all handed over at once."""
    spec = StreamSpec(prompt_tokens=rows + 1, max_rows=rows, prefix_tokens=1)
    wide = encoder().open.model_copy(update={"row_width": width, "streams": {"cond": spec}})

    async def run() -> AsyncGenerator[EngineEvent, None]:
        yield RowsEvent(start=0, rows=torch.zeros(rows, width), token_ids=list(range(rows)))
        yield finished(list(range(rows + 1)))

    return HandoffBody(HandoffEncoder(wide), {"cond": submitted(run())}, overlap=True, received_at=0.0, pixels={})


def test_a_dit_that_stops_taking_the_body_ends_the_exchange_after_the_stall_timeout():
    with pytest.raises(ExchangeEnded) as ended:
        # 64 MB of rows: far more than the socket buffers between the two hold, so the writes stop.
        asyncio.run(exchange(wide_body(rows=4096, width=4096), dit_reads=False))
    assert isinstance(ended.value.__cause__, DitUnavailable) and "took no handoff bytes" in str(ended.value.__cause__)
    assert STALL <= ended.value.seconds < DEADLINE


def test_a_dit_that_holds_the_rows_and_falls_silent_ends_the_exchange_after_the_stall_timeout():
    with pytest.raises(ExchangeEnded) as ended:
        asyncio.run(exchange(body(run_of([5, 6, 7, 8], [3])), dit_reads=True))
    assert isinstance(ended.value.__cause__, DitUnavailable) and "timed out" in str(ended.value.__cause__)
    assert STALL <= ended.value.seconds < DEADLINE


def test_an_engine_slower_than_the_stall_timeout_is_waited_for():
    async def slow_run() -> AsyncGenerator[EngineEvent, None]:
        async for event in run_of([5, 6, 7, 8], [1, 1, 1]):
            await asyncio.sleep(STALL)  # each step longer than the stall bound, with nothing to write meanwhile
            yield event

    assert asyncio.run(exchange(body(slow_run()))) > 3 * STALL


def test_a_failure_of_the_engine_is_raised_as_itself_not_as_the_dits():
    overflow = RowQueueOverflow("rows fell behind")
    with pytest.raises(ExchangeEnded) as ended:
        asyncio.run(exchange(body(run_of([5, 6, 7, 8], [1, 1], fail=overflow))))
    assert ended.value.__cause__ is overflow


def test_a_dit_nobody_listens_for_is_unreachable():
    async def reserve() -> str:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{free_port()}"
            return await HandoffClient(session, url, "t", deadline_seconds=60.0, stall_seconds=STALL).reserve("r")

    with pytest.raises(DitUnreachable):
        asyncio.run(reserve())
