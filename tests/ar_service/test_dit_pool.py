"""The pool of DiT replicas on its own (replicas answer through httpx's MockTransport)."""

from __future__ import annotations

import asyncio

import httpx

from ar_service.dit_pool import DitPool
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
    """Ready; then either unreachable for handoffs (fails before reading a byte, as a refused TCP
    connect does) or a DiT that reads the body and answers ``done``."""

    def __init__(self, url: str, reachable: bool, tried: list[str]) -> None:
        self.url, self.reachable, self.tried = url, reachable, tried

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return ready_with()(request)
        self.tried.append(self.url)
        if not self.reachable:
            raise httpx.ConnectError("refused", request=request)
        await request.aread()
        return httpx.Response(200, stream=httpx.ByteStream(encode_result(DoneFrame(request_id="req_body"))))


def test_an_unreachable_replica_hands_the_request_to_another_before_any_row_is_sent():
    tried: list[str] = []

    async def scenario():
        pool = DitPool(
            ["http://10.0.0.1:8001", "http://10.0.0.2:8001"],
            make_client=lambda url: httpx.AsyncClient(base_url=url, transport=FakeDit(url, "10.0.0.2" in url, tried)),
            token="t",
            deadline_seconds=5.0,
            hidden_size=576,
            conditioning="qwen_image",
        )
        await pool.refresh()
        await pool.state()
        body = body_of({"cond": run_of([5, 6, 7, 8], [3])})
        async with body:
            result = await pool.exchange("req_body", body)
        return result, [r.outstanding for r in pool.replicas.values()]

    result, outstanding = asyncio.run(scenario())
    assert result.done.request_id == "req_body" and outstanding == [0, 0]
    assert tried == ["http://10.0.0.1:8001", "http://10.0.0.2:8001"]
