"""What the AR learns from its DiT's /readyz: readiness, the announced capabilities, compatibility."""

from __future__ import annotations

import asyncio

import httpx

from ar_service.dit_peer import DitPeer
from tests.support.capabilities import DIT


def peer_answering(handler) -> DitPeer:
    client = httpx.AsyncClient(base_url="http://dit", transport=httpx.MockTransport(handler))
    return DitPeer(client, hidden_size=576, layer=8, conditioning="qwen_image")


def ready(capabilities: dict) -> httpx.Response:
    return httpx.Response(200, json={"status": "ready", "reason": "ready", "capabilities": capabilities})


def test_a_ready_dit_hands_over_its_capabilities():
    state = asyncio.run(peer_answering(lambda _: ready(DIT.model_dump(mode="json"))).state())
    assert state.ready and state.capabilities == DIT


def test_a_dit_for_other_rows_is_not_ready_with_the_reason():
    narrow = DIT.model_copy(update={"hidden_size": 1024}).model_dump(mode="json")
    state = asyncio.run(peer_answering(lambda _: ready(narrow)).state())
    assert not state.ready and "1024" in state.reason and state.capabilities is None
    other = DIT.model_copy(update={"conditioning": ["ar_generated"]}).model_dump(mode="json")
    assert not asyncio.run(peer_answering(lambda _: ready(other)).state()).ready


def test_a_dit_trained_on_another_layers_rows_is_not_ready_with_the_reason_and_one_that_names_none_is():
    other = DIT.model_copy(update={"hidden_layer": 30}).model_dump(mode="json")
    state = asyncio.run(peer_answering(lambda _: ready(other)).state())
    assert not state.ready and "layer 30" in state.reason and "layer 8" in state.reason
    same = DIT.model_copy(update={"hidden_layer": 8}).model_dump(mode="json")
    assert asyncio.run(peer_answering(lambda _: ready(same)).state()).ready
    unsaid = DIT.model_copy(update={"hidden_layer": None}).model_dump(mode="json")
    assert asyncio.run(peer_answering(lambda _: ready(unsaid)).state()).ready


def test_not_ready_unreachable_or_silent_dits_are_not_ready():
    def unreachable(_):
        raise httpx.ConnectError("refused")

    for handler in (
        lambda _: httpx.Response(503, json={"status": "not_ready", "reason": "loading model"}),
        unreachable,
        lambda _: httpx.Response(200, json={"status": "ready", "reason": "ready"}),
    ):
        assert not asyncio.run(peer_answering(handler).state()).ready


def test_the_dit_is_asked_again_only_after_the_recheck_interval():
    calls = []

    def handler(request):
        calls.append(request)
        return ready(DIT.model_dump(mode="json"))

    async def twice():
        peer = peer_answering(handler)
        await peer.state()
        await peer.state()

    asyncio.run(twice())
    assert len(calls) == 1


def test_after_a_failed_request_the_next_one_probes_again():
    calls = []

    def handler(request):
        calls.append(request)
        return ready(DIT.model_dump(mode="json"))

    async def scenario():
        peer = peer_answering(handler)
        await peer.state()
        peer.forget()
        await peer.state()

    asyncio.run(scenario())
    assert len(calls) == 2


def test_callers_that_arrive_together_share_one_probe():
    calls = []

    async def handler(request):
        calls.append(request)
        await asyncio.sleep(0.05)
        return ready(DIT.model_dump(mode="json"))

    async def burst():
        peer = peer_answering(handler)
        return await asyncio.gather(*(peer.state() for _ in range(200)))

    states = asyncio.run(burst())
    assert len(calls) == 1 and all(state.ready for state in states)


def test_a_stale_state_is_answered_at_once_while_one_probe_refreshes_it(monkeypatch):
    answers = iter([ready(DIT.model_dump(mode="json")), httpx.Response(503, json={"status": "not_ready"})])
    release = asyncio.Event()

    async def handler(_):
        answer = next(answers)
        if answer.status_code == 503:
            await release.wait()
        return answer

    async def scenario():
        peer = peer_answering(handler)
        assert (await peer.state()).ready
        monkeypatch.setattr("ar_service.dit_peer.RECHECK_SECONDS", 0.0)
        # The refresh is under way and stuck at the DiT; requests still get the last state, at once.
        states = await asyncio.wait_for(asyncio.gather(*(peer.state() for _ in range(50))), timeout=1)
        assert all(state.ready for state in states)
        release.set()
        await asyncio.sleep(0.01)
        return peer.last

    assert not asyncio.run(scenario()).ready
