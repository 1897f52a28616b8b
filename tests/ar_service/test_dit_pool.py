"""The pool of DiT replicas on its own (replicas answer through httpx's MockTransport)."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from ar_service.dit_pool import DitPool
from ar_service.handoff_client import DitBusy, DitUnavailable
from shared.result_frames import DoneFrame, encode_result
from tests.ar_service.test_handoff_body import body_of, run_of
from tests.support.capabilities import DIT


def pool_of(*urls: str, answers) -> DitPool:
    return DitPool(
        list(urls),
        make_client=lambda url: httpx.AsyncClient(base_url=url, transport=httpx.MockTransport(answers(url))),
        token="t",
        deadline_seconds=5.0,
        hidden_size=576,
        layer=30,
        conditioning="qwen_image",
    )


def ready_with(capabilities=DIT):
    def answer(_):
        return httpx.Response(
            200, json={"status": "ready", "reason": "ready", "capabilities": capabilities.model_dump(mode="json")}
        )

    return answer


def test_several_urls_are_several_replicas_and_their_capacity_adds_up():
    async def scenario():
        pool = pool_of("http://10.0.0.1:8001", "http://10.0.0.2:8001", answers=lambda url: ready_with())
        await pool.refresh()
        return await pool.state()

    state = asyncio.run(scenario())
    assert state.ready and state.capacity == 2 * DIT.capacity.max_outstanding and "2/2" in state.reason


def test_a_dns_name_becomes_one_replica_per_address():
    async def scenario():
        pool = pool_of("http://localhost:8001", answers=lambda url: ready_with())
        await pool.refresh()
        return sorted(pool.replicas)

    assert asyncio.run(scenario()) == ["http://127.0.0.1:8001"]


def test_a_failed_dns_lookup_keeps_the_replicas_of_the_last_answer():
    async def scenario():
        pool = pool_of("http://localhost:8001", answers=lambda url: ready_with())
        await pool.refresh()

        async def no_dns(*args, **kwargs):
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

        asyncio.get_running_loop().getaddrinfo = no_dns  # type: ignore[method-assign]
        await pool.refresh()
        return {url: replica.retired for url, replica in pool.replicas.items()}, (await pool.state()).ready

    replicas, ready = asyncio.run(scenario())
    assert replicas == {"http://127.0.0.1:8001": False} and ready


def test_the_least_loaded_ready_replica_with_room_is_picked():
    async def scenario():
        def answers(url):
            if "10.0.0.3" in url:
                return lambda _: httpx.Response(503, json={"status": "not_ready", "reason": "loading"})
            return ready_with()

        pool = pool_of("http://10.0.0.1:8001", "http://10.0.0.2:8001", "http://10.0.0.3:8001", answers=answers)
        await pool.refresh()
        await pool.state()
        pool.replicas["http://10.0.0.1:8001"].outstanding = 2
        first = pool._pick(exclude=set())
        pool.replicas["http://10.0.0.2:8001"].outstanding = DIT.capacity.max_outstanding  # full
        second = pool._pick(exclude=set())
        assert first is not None and second is not None
        return first.url, second.url

    assert asyncio.run(scenario()) == ("http://10.0.0.2:8001", "http://10.0.0.1:8001")


def test_a_replica_that_leaves_the_answer_takes_no_new_work():
    async def scenario():
        pool = pool_of("http://10.0.0.1:8001", answers=lambda url: ready_with())
        await pool.refresh()
        await pool.state()
        replica = pool.replicas["http://10.0.0.1:8001"]
        replica.outstanding = 1  # a handoff still on it
        pool.targets = []
        await pool.refresh()
        return replica.retired, pool._pick(exclude=set()), "http://10.0.0.1:8001" in pool.replicas

    assert asyncio.run(scenario()) == (True, None, True)


class FakeDit(httpx.AsyncBaseTransport):
    """Ready; then it answers reservations as ``answer`` says ("ok", "busy", "not_ready" or
    "unreachable", a refused TCP connect) after ``delay`` seconds, takes cancellations, and reads a
    handoff body to answer ``done``."""

    def __init__(self, url: str, answer: str, seen: list[str], delay: float = 0.0) -> None:
        self.url, self.answer, self.seen, self.delay = url, answer, seen, delay

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return ready_with()(request)
        self.seen.append(f"{request.method} {self.url}{request.url.path}")
        if request.method == "DELETE":
            return httpx.Response(204)
        if request.url.path == "/v1/handoff/reservations":
            await asyncio.sleep(self.delay)
            if self.answer == "unreachable":
                raise httpx.ConnectError("refused", request=request)
            if self.answer != "ok":
                status = 429 if self.answer == "busy" else 503
                return httpx.Response(status, json={"error": {"message": self.answer, "code": self.answer}})
            return httpx.Response(201, json={"reservation": "r-1", "expires_in": 30})
        assert request.headers["x-ardit-reservation"] == "r-1"
        await request.aread()
        return httpx.Response(200, stream=httpx.ByteStream(encode_result(DoneFrame(request_id="req_body"))))


@pytest.mark.parametrize("refusal", ["unreachable", "busy", "not_ready"])
def test_a_replica_that_refuses_a_reservation_hands_the_request_to_another_before_any_engine_work(refusal):
    seen: list[str] = []

    async def scenario():
        answers = {"http://10.0.0.1:8001": refusal, "http://10.0.0.2:8001": "ok"}
        pool = DitPool(
            list(answers),
            make_client=lambda url: httpx.AsyncClient(base_url=url, transport=FakeDit(url, answers[url], seen)),
            token="t",
            deadline_seconds=5.0,
            hidden_size=576,
            layer=30,
            conditioning="qwen_image",
        )
        await pool.refresh()
        await pool.state()
        async with pool.reserve("req_body") as dit:
            # Inside the block is where the engine work runs: both replicas were asked before it.
            assert seen == [
                "POST http://10.0.0.1:8001/v1/handoff/reservations",
                "POST http://10.0.0.2:8001/v1/handoff/reservations",
            ]
            body = body_of({"cond": run_of([5, 6, 7, 8], [3])})
            async with body:
                result = await dit.exchange(body)
        return result, [r.outstanding for r in pool.replicas.values()]

    result, outstanding = asyncio.run(scenario())
    assert result.done.request_id == "req_body" and outstanding == [0, 0]
    assert seen[-1] == "POST http://10.0.0.2:8001/v1/handoff"


def fake_pool(answers: dict[str, str], seen: list[str], delay: float = 0.0) -> DitPool:
    return DitPool(
        list(answers),
        make_client=lambda url: httpx.AsyncClient(base_url=url, transport=FakeDit(url, answers[url], seen, delay)),
        token="t",
        deadline_seconds=5.0,
        hidden_size=576,
        layer=30,
        conditioning="qwen_image",
    )


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
        pool = fake_pool({"http://10.0.0.1:8001": refusals[0], "http://10.0.0.2:8001": refusals[1]}, [])
        await pool.refresh()
        await pool.state()
        with pytest.raises(error, match=message):
            async with pool.reserve("req_body"):
                raise AssertionError("no place was reserved, so no engine work may start")
        return [r.outstanding for r in pool.replicas.values()]

    assert asyncio.run(scenario()) == [0, 0]


def test_a_request_cancelled_while_its_place_is_asked_for_gives_the_place_back():
    seen: list[str] = []

    async def scenario():
        pool = fake_pool({"http://10.0.0.1:8001": "ok"}, seen, delay=0.2)
        await pool.refresh()
        await pool.state()

        async def reserve_and_work() -> None:
            async with pool.reserve("req_body"):
                raise AssertionError("cancelled before the place was reserved")

        asking = asyncio.ensure_future(reserve_and_work())
        await asyncio.sleep(0.05)
        asking.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await asking
        return [r.outstanding for r in pool.replicas.values()]

    assert asyncio.run(scenario()) == [0]
    assert seen == [
        "POST http://10.0.0.1:8001/v1/handoff/reservations",
        "DELETE http://10.0.0.1:8001/v1/handoff/reservations/r-1",
    ]
