"""The image routes' door: a request takes its admission place on arrival, before anything parses it;
the line's refusals are answered there, and a place nobody took is given back."""

from __future__ import annotations

import asyncio
import json

import httpx
from fastapi import Request
from prometheus_client import CollectorRegistry
from starlette.types import Receive, Scope, Send

from ar_service.admission import AdmissionPlace, RequestAdmission
from ar_service.api.admission_door import AdmissionDoor, take_place
from ar_service.dit_pool import DitPool
from ar_service.metrics import ArMetrics
from ar_service.readiness import ArReadiness
from services.errors import ApiError
from tests.support.capabilities import DIT

IMAGES = "/v1/images/generations"


async def ready_pair(engine_ready: bool = True) -> ArReadiness:
    answer = {"status": "ready", "reason": "ready", "capabilities": DIT.model_dump(mode="json")}
    pool = DitPool(
        ["http://10.0.0.1:8001"],
        make_client=lambda url: httpx.AsyncClient(
            base_url=url, transport=httpx.MockTransport(lambda _: httpx.Response(200, json=answer))
        ),
        token="t",
        deadline_seconds=5.0,
        hidden_size=DIT.hidden_size,
        conditioning="qwen_image",
    )
    await pool.refresh()
    await pool.state()
    return ArReadiness(pool, engine_ready=engine_ready)


class App:
    """The app behind the door: records what reached it; takes the request's place when told to."""

    def __init__(self, take: bool = False) -> None:
        self.calls: list[Scope] = []
        self.take = take
        self.taken: list[AdmissionPlace | None] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls.append(scope)
        if self.take:
            self.taken.append(take_place(Request(scope)))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


async def call(door: AdmissionDoor, path: str = IMAGES, method: str = "POST") -> tuple[int, dict[str, str], bytes]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"not even json", "more_body": False}

    async def send(message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": [], "query_string": b"", "state": {}}
    await door(scope, receive, send)
    headers = {k.decode(): v.decode() for k, v in sent[0].get("headers", [])}
    return sent[0]["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


def door_for(app: App, admission: RequestAdmission, readiness: ArReadiness, refusals: list[ApiError]) -> AdmissionDoor:
    return AdmissionDoor(app, admission=admission, readiness=readiness, paths=[IMAGES], on_refusal=refusals.append)


def test_a_request_the_line_has_no_room_for_is_refused_at_the_door_and_never_parsed():
    async def scenario():
        readiness = await ready_pair()
        admission = RequestAdmission(max_queued=0, max_wait=60.0, metrics=ArMetrics(CollectorRegistry()))
        held = [admission.enter(DIT.capacity.max_outstanding) for _ in range(DIT.capacity.max_outstanding)]
        app, refusals = App(), list[ApiError]()
        status, headers, body = await call(door_for(app, admission, readiness, refusals))
        return status, headers, json.loads(body), app.calls, refusals, held

    status, headers, body, reached, refusals, held = asyncio.run(scenario())
    assert status == 429 and int(headers["retry-after"]) >= 1
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert reached == [] and [r.status for r in refusals] == [429]
    assert all(place.started for place in held)


def test_a_place_the_app_did_not_take_is_given_back_when_the_request_ends():
    async def scenario():
        readiness = await ready_pair()
        admission = RequestAdmission(max_queued=4, max_wait=60.0, metrics=ArMetrics(CollectorRegistry()))
        app = App()
        status, _, _ = await call(door_for(app, admission, readiness, []))
        return status, len(app.calls), admission.in_flight

    assert asyncio.run(scenario()) == (200, 1, 0)


def test_a_place_the_app_took_is_the_apps_to_turn_into_a_slot():
    async def scenario():
        readiness = await ready_pair()
        admission = RequestAdmission(max_queued=4, max_wait=60.0, metrics=ArMetrics(CollectorRegistry()))
        app = App(take=True)
        await call(door_for(app, admission, readiness, []))
        in_flight_after_the_request = admission.in_flight
        place = app.taken[0]
        assert place is not None
        ticket = await place.turn()
        ticket.release(served=True)
        return in_flight_after_the_request, admission.in_flight

    assert asyncio.run(scenario()) == (1, 0)


def test_before_the_pair_is_known_ready_and_off_the_image_routes_requests_pass_without_a_place():
    async def scenario():
        admission = RequestAdmission(max_queued=0, max_wait=60.0, metrics=ArMetrics(CollectorRegistry()))
        starting, app = await ready_pair(engine_ready=False), App(take=True)
        await call(door_for(app, admission, starting, []))
        ready, other = await ready_pair(), App(take=True)
        await call(door_for(other, admission, ready, []), path="/v1/models", method="GET")
        await call(door_for(other, admission, ready, []), path=IMAGES, method="GET")
        return app.taken + other.taken, admission.in_flight

    assert asyncio.run(scenario()) == ([None, None, None], 0)
