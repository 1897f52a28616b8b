"""The pool of DiT replicas on its own (each replica a stand-in DiT on a loopback port)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from ar_service.dit_pool import DitPool
from ar_service.handoff_client import DitBusy, DitUnavailable
from shared.result_frames import DoneFrame, encode_result
from shared.row_recipe import RowRecipe
from tests.ar_service.test_handoff_body import body_of, run_of
from tests.support.capabilities import DIT
from tests.support.fake_dit import fake_dit, ready
from tests.support.waiting import until


def pool_of(*urls: str) -> DitPool:
    return DitPool(
        list(urls),
        make_session=aiohttp.ClientSession,
        token="t",
        deadline_seconds=5.0,
        stall_seconds=5.0,
        rows=RowRecipe(layers=[30]),
        row_width=576,
    )


async def always_ready(_: web.Request) -> web.Response:
    return ready()


async def not_ready(_: web.Request) -> web.Response:
    return web.json_response({"status": "not_ready", "reason": "loading"}, status=503)


def test_several_urls_are_several_replicas_and_their_capacity_adds_up():
    async def scenario():
        async with fake_dit(always_ready) as one, fake_dit(always_ready) as two:
            pool = pool_of(one.url, two.url)
            await pool.refresh()
            try:
                return await pool.state()
            finally:
                await pool.aclose()

    state = asyncio.run(scenario())
    assert state.ready and state.capacity == 2 * DIT.capacity.max_outstanding and "2/2" in state.reason


def test_a_dns_name_becomes_one_replica_per_address():
    async def scenario():
        pool = pool_of("http://localhost:8001")
        await pool.refresh()
        try:
            return sorted(pool.replicas)
        finally:
            await pool.aclose()

    assert asyncio.run(scenario()) == ["http://127.0.0.1:8001"]


def test_a_failed_dns_lookup_keeps_the_replicas_of_the_last_answer():
    async def scenario():
        async with fake_dit(always_ready) as dit:
            pool = pool_of(dit.url.replace("127.0.0.1", "localhost"))
            await pool.refresh()

            async def no_dns(*args, **kwargs):
                raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

            asyncio.get_running_loop().getaddrinfo = no_dns  # type: ignore[method-assign]
            await pool.refresh()
            try:
                return {u: r.retired for u, r in pool.replicas.items()}, (await pool.state()).ready, dit.url
            finally:
                await pool.aclose()

    replicas, ready_now, url = asyncio.run(scenario())
    assert replicas == {url: False} and ready_now


def test_the_least_loaded_ready_replica_with_room_is_picked():
    async def scenario():
        async with fake_dit(always_ready) as one, fake_dit(always_ready) as two, fake_dit(not_ready) as three:
            pool = pool_of(one.url, two.url, three.url)
            await pool.refresh()
            await pool.state()
            pool.replicas[one.url].outstanding = 2
            first = pool._pick(exclude=set())
            pool.replicas[two.url].outstanding = DIT.capacity.max_outstanding  # full
            second = pool._pick(exclude=set())
            await pool.aclose()
            assert first is not None and second is not None
            return (first.url, second.url) == (two.url, one.url)

    assert asyncio.run(scenario())


def test_a_replica_that_leaves_the_answer_takes_no_new_work():
    async def scenario():
        async with fake_dit(always_ready) as dit:
            pool = pool_of(dit.url)
            await pool.refresh()
            await pool.state()
            replica = pool.replicas[dit.url]
            replica.outstanding = 1  # a handoff still on it
            pool.targets = []
            await pool.refresh()
            outcome = replica.retired, pool._pick(exclude=set()), dit.url in pool.replicas
            await pool.aclose()
            return outcome

    assert asyncio.run(scenario()) == (True, None, True)


def fake_replica(answer: str, seen: list[str], delay: float = 0.0):
    """Ready; then it answers reservations as ``answer`` says ("ok", "busy" or "not_ready") after ``delay``
    seconds, takes cancellations, and reads a handoff body to answer ``done``."""

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path == "/readyz":
            return ready()
        seen.append(f"{request.method} {request.path}")
        if request.method == "DELETE":
            return web.Response(status=204)
        if request.path == "/v1/handoff/reservations":
            await asyncio.sleep(delay)
            if answer != "ok":
                status = 429 if answer == "busy" else 503
                return web.json_response({"error": {"message": answer, "code": answer}}, status=status)
            return web.json_response({"reservation": "r-1", "expires_in": 30}, status=201)
        assert request.headers["x-ardit-reservation"] == "r-1"
        await request.read()
        return web.Response(body=encode_result(DoneFrame(request_id="req_body")))

    return handler


@asynccontextmanager
async def fake_pool(answers: list[str], delay: float = 0.0) -> AsyncIterator[tuple[DitPool, list[list[str]]]]:
    """A pool of one stand-in replica per answer, found ready; with what each replica was asked. A replica
    answering "unreachable" stops listening once found ready: its reservation's connection is refused."""
    seen: list[list[str]] = [[] for _ in answers]
    async with AsyncExitStack() as stack:
        dits = [
            await stack.enter_async_context(fake_dit(fake_replica(a, seen[i], delay))) for i, a in enumerate(answers)
        ]
        pool = pool_of(*(dit.url for dit in dits))
        await pool.refresh()
        await pool.state()
        for answer, dit in zip(answers, dits, strict=True):
            if answer == "unreachable":
                await dit.stop()
        try:
            yield pool, seen
        finally:
            await pool.aclose()


@pytest.mark.parametrize("refusal", ["unreachable", "busy", "not_ready"])
def test_a_replica_that_refuses_a_reservation_hands_the_request_to_another_before_any_engine_work(refusal):
    async def scenario():
        async with fake_pool([refusal, "ok"]) as (pool, seen):
            async with pool.reserve("req_body") as dit:
                # Inside the block is where the engine work runs: both replicas were asked before it.
                asked = ["POST /v1/handoff/reservations"]
                assert seen == [[] if refusal == "unreachable" else asked, asked]
                body = body_of({"cond": run_of([5, 6, 7, 8], [3])})
                async with body:
                    result = await dit.exchange(body)
            return result, [r.outstanding for r in pool.replicas.values()], seen

    result, outstanding, seen = asyncio.run(scenario())
    assert result.done.request_id == "req_body" and outstanding == [0, 0]
    assert seen[1][-1] == "POST /v1/handoff"


@pytest.mark.parametrize(
    ("refusals", "error", "message"),
    [
        (["busy", "busy"], DitBusy, "every DiT replica is full"),
        (["busy", "unreachable"], DitBusy, "every DiT replica is full"),
        (["not_ready", "unreachable"], DitUnavailable, "no DiT replica is ready with room"),
    ],
)
def test_when_every_replica_refuses_the_request_fails_before_any_engine_work(refusals, error, message):
    async def scenario():
        async with fake_pool(refusals) as (pool, _):
            with pytest.raises(error, match=message):
                async with pool.reserve("req_body"):
                    raise AssertionError("no place was reserved, so no engine work may start")
            return [r.outstanding for r in pool.replicas.values()]

    assert asyncio.run(scenario()) == [0, 0]


def test_a_request_cancelled_while_its_place_is_asked_for_gives_the_place_back():
    async def scenario():
        async with fake_pool(["ok"], delay=0.2) as (pool, seen):

            async def reserve_and_work() -> None:
                async with pool.reserve("req_body"):
                    raise AssertionError("cancelled before the place was reserved")

            asking = asyncio.ensure_future(reserve_and_work())
            await until(lambda: seen[0] == ["POST /v1/handoff/reservations"], what="the DiT was asked for a place")
            asking.cancel()  # the client left, before the DiT answered
            with pytest.raises(asyncio.CancelledError):
                await asking
            return [r.outstanding for r in pool.replicas.values()], seen

    outstanding, seen = asyncio.run(scenario())
    assert outstanding == [0]
    assert seen == [["POST /v1/handoff/reservations", "DELETE /v1/handoff/reservations/r-1"]]
