"""What the AR learns from its DiT's /readyz: readiness, the announced capabilities, compatibility."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from ar_service.dit_peer import DitPeer
from shared.row_recipe import RowRecipe
from tests.support.capabilities import DIT
from tests.support.fake_dit import Handler, fake_dit, ready
from tests.support.ports import free_port
from tests.support.waiting import until

AR_ROWS = RowRecipe(layers=[8])


def peer_at(session: aiohttp.ClientSession, url: str) -> DitPeer:
    return DitPeer(session, url, rows=AR_ROWS, row_width=576)


def state_of(handler: Handler):
    async def probe():
        async with fake_dit(handler) as dit, aiohttp.ClientSession() as session:
            return await peer_at(session, dit.url).state()

    return asyncio.run(probe())


def answering(answer: web.Response) -> Handler:
    async def handler(_: web.Request) -> web.Response:
        return answer

    return handler


def test_a_ready_dit_hands_over_its_capabilities():
    state = state_of(answering(ready()))
    assert state.ready and state.capabilities == DIT


def test_a_dit_for_other_rows_is_not_ready_with_the_reason():
    state = state_of(answering(ready(DIT.model_copy(update={"row_width": 1024}))))
    assert not state.ready and "1024" in state.reason and state.capabilities is None
    assert not state_of(answering(ready(DIT.model_copy(update={"conditioning": ["ar_generated"]})))).ready


def test_a_dit_trained_on_another_layers_rows_is_not_ready_with_the_reason_and_one_that_names_none_is():
    state = state_of(answering(ready(DIT.model_copy(update={"rows": RowRecipe(layers=[30])}))))
    assert not state.ready and "[8]" in state.reason and "[30]" in state.reason
    assert state_of(answering(ready(DIT.model_copy(update={"rows": AR_ROWS})))).ready
    assert state_of(answering(ready(DIT.model_copy(update={"rows": None})))).ready


def test_a_dit_reading_rows_otherwise_than_this_ar_is_not_ready_naming_each_difference():
    other = RowRecipe(layers=[8], final_norm=False, template=None, chat_template_kwargs={"enable_thinking": True})
    state = state_of(answering(ready(DIT.model_copy(update={"rows": other}))))
    assert not state.ready
    for part in ("final_norm True (not False)", "template", "chat_template_kwargs {} (not {'enable_thinking': True})"):
        assert part in state.reason


def test_not_ready_or_silent_dits_are_not_ready():
    for answer in (
        web.json_response({"status": "not_ready", "reason": "loading model"}, status=503),
        web.json_response({"status": "ready", "reason": "ready"}),
        web.Response(text="not json"),
    ):
        assert not state_of(answering(answer)).ready


def test_an_unreachable_dit_is_not_ready():
    async def probe():
        async with aiohttp.ClientSession() as session:
            return await peer_at(session, f"http://127.0.0.1:{free_port()}").state()

    state = asyncio.run(probe())
    assert not state.ready and state.reason == "DiT service unreachable"


def test_a_dit_that_does_not_answer_its_probe_in_time_is_not_ready(monkeypatch):
    monkeypatch.setattr("ar_service.dit_peer.PROBE_TIMEOUT_SECONDS", 0.2)

    async def frozen(_: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return ready()

    assert not state_of(frozen).ready


def counting(calls: list[web.Request], delay: float = 0.0) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        calls.append(request)
        await asyncio.sleep(delay)
        return ready()

    return handler


def test_the_dit_is_asked_again_only_after_the_recheck_interval():
    calls: list[web.Request] = []

    async def twice():
        async with fake_dit(counting(calls)) as dit, aiohttp.ClientSession() as session:
            peer = peer_at(session, dit.url)
            await peer.state()
            await peer.state()

    asyncio.run(twice())
    assert len(calls) == 1


def test_after_a_failed_request_the_next_one_probes_again():
    calls: list[web.Request] = []

    async def scenario():
        async with fake_dit(counting(calls)) as dit, aiohttp.ClientSession() as session:
            peer = peer_at(session, dit.url)
            await peer.state()
            peer.forget()
            await peer.state()

    asyncio.run(scenario())
    assert len(calls) == 2


def test_callers_that_arrive_together_share_one_probe():
    calls: list[web.Request] = []

    async def burst():
        async with fake_dit(counting(calls, delay=0.05)) as dit, aiohttp.ClientSession() as session:
            peer = peer_at(session, dit.url)
            return await asyncio.gather(*(peer.state() for _ in range(200)))

    states = asyncio.run(burst())
    assert len(calls) == 1 and all(state.ready for state in states)


def test_a_stale_state_is_answered_at_once_while_one_probe_refreshes_it(monkeypatch):
    answers = iter([ready(), web.json_response({"status": "not_ready"}, status=503)])
    release = asyncio.Event()

    async def handler(_: web.Request) -> web.Response:
        answer = next(answers)
        if answer.status == 503:
            await release.wait()
        return answer

    async def scenario():
        async with fake_dit(handler) as dit, aiohttp.ClientSession() as session:
            peer = peer_at(session, dit.url)
            assert (await peer.state()).ready
            monkeypatch.setattr("ar_service.dit_peer.RECHECK_SECONDS", 0.0)
            # The refresh is under way and stuck at the DiT; requests still get the last state, at once.
            states = await asyncio.wait_for(asyncio.gather(*(peer.state() for _ in range(50))), timeout=1)
            assert all(state.ready for state in states)
            release.set()
            await until(lambda: not peer.last.ready, what="the refresh brought the DiT's 503 in")
            return peer.last

    assert not asyncio.run(scenario()).ready
