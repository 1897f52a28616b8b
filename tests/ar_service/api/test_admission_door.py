"""The image routes' door: a request takes its admission place on arrival, before anything parses it;
the line's refusals are answered, counted and given an id there, a place nobody took is given back,
and what the door cannot decide alone goes on to the layers behind it."""

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
from services.app_metrics import AppMetrics
from services.auth import BearerAuth
from services.drain import Drain
from tests.support.capabilities import DIT

IMAGES = "/v1/images/generations"
KEY = "sk-door"
INTERNAL_PORT = 8100


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
        layer=30,
        conditioning="qwen_image",
    )
    await pool.refresh()
    await pool.state()
    return ArReadiness(pool, engine_ready=engine_ready)


class App:
    """The app behind the door: records what reached it; takes the request's place when told to."""

    def __init__(self, take: bool = False, events: list[object] | None = None) -> None:
        self.calls: list[Scope] = []
        self.take = take
        self.taken: list[AdmissionPlace | None] = []
        self.events = events if events is not None else []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls.append(scope)
        self.events.append("work")
        if self.take:
            self.taken.append(take_place(Request(scope)))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


async def call(
    door: AdmissionDoor,
    path: str = IMAGES,
    method: str = "POST",
    key: str | None = KEY,
    port: int = 8000,
    request_id: str | None = None,
) -> tuple[int, dict[str, str], bytes]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"not even json", "more_body": False}

    async def send(message) -> None:
        sent.append(message)

    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    if request_id:
        headers.append((b"x-request-id", request_id.encode()))
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": headers,
        "query_string": b"",
        "server": ("127.0.0.1", port),
        "state": {},
    }
    await door(scope, receive, send)
    answer_headers = {k.decode(): v.decode() for k, v in sent[0].get("headers", [])}
    return sent[0]["status"], answer_headers, b"".join(m.get("body", b"") for m in sent[1:])


def door_for(
    app: App,
    admission: RequestAdmission,
    readiness: ArReadiness,
    metrics: AppMetrics | None = None,
    drain: Drain | None = None,
) -> AdmissionDoor:
    return AdmissionDoor(
        app,
        admission=admission,
        readiness=readiness,
        paths=[IMAGES],
        auth=BearerAuth([KEY], what="API key", missing_code="missing_api_key", invalid_code="invalid_api_key"),
        drain=drain or Drain(60.0),
        metrics=metrics or AppMetrics(CollectorRegistry(), "ar"),
        internal_port=INTERNAL_PORT,
    )


def full(admission: RequestAdmission) -> list[AdmissionPlace]:
    """Every slot taken, and no line: the next request is refused."""
    return [admission.enter(DIT.capacity.max_outstanding) for _ in range(DIT.capacity.max_outstanding)]


def test_a_request_the_line_has_no_room_for_is_refused_at_the_door_counted_and_never_parsed():
    async def scenario():
        readiness = await ready_pair()
        admission = RequestAdmission(max_queued=0, max_wait=60.0, metrics=ArMetrics(CollectorRegistry()))
        held = full(admission)
        app, metrics = App(), AppMetrics(CollectorRegistry(), "ar")
        status, headers, body = await call(door_for(app, admission, readiness, metrics), request_id="req-from-client")
        return status, headers, json.loads(body), app.calls, metrics, held

    status, headers, body, reached, metrics, held = asyncio.run(scenario())
    assert status == 429 and int(headers["retry-after"]) >= 1
    assert headers["x-request-id"] == "req-from-client"
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert reached == [] and all(place.started for place in held)
    counted = {"route": IMAGES, "method": "POST", "status": "429"}
    assert metrics.registry.get_sample_value("ardit_ar_http_requests_total", counted) == 1
    refusals = {"status": "429", "code": "rate_limit_exceeded"}
    assert metrics.registry.get_sample_value("ardit_ar_api_errors_total", refusals) == 1


def test_a_refusal_waits_behind_at_most_one_admitted_requests_work_however_the_burst_arrives():
    """Here the refused requests reach the door a loop pass after the admitted ones: one admitted request
    may go on to its work first, the others wait until the refusals are answered."""

    async def scenario():
        readiness = await ready_pair()
        admission = RequestAdmission(max_queued=3, max_wait=60.0, metrics=ArMetrics(CollectorRegistry()))
        full(admission).pop().leave()  # one slot free, and a line of three
        events: list[object] = []
        door = door_for(App(take=True, events=events), admission, readiness)  # places kept: none frees

        async def answer() -> None:
            status, _, _ = await call(door)
            events.append(status)

        admitted = [asyncio.create_task(answer()) for _ in range(4)]
        await asyncio.sleep(0)
        await asyncio.gather(*admitted, *(answer() for _ in range(3)))
        return events

    events = asyncio.run(scenario())
    assert events[: events.index(429)].count("work") <= 1
    assert events.count(429) == 3 and events[-1] != 429
    assert events.count("work") == 4


def test_a_place_the_app_did_not_take_is_given_back_when_the_request_ends():
    async def scenario():
        readiness = await ready_pair()
        admission = RequestAdmission(max_queued=4, max_wait=60.0, metrics=ArMetrics(CollectorRegistry()))
        app = App()
        status, _, _ = await call(door_for(app, admission, readiness))
        return status, len(app.calls), admission.in_flight

    assert asyncio.run(scenario()) == (200, 1, 0)


def test_a_place_the_app_took_is_the_apps_to_turn_into_a_slot():
    async def scenario():
        readiness = await ready_pair()
        admission = RequestAdmission(max_queued=4, max_wait=60.0, metrics=ArMetrics(CollectorRegistry()))
        app = App(take=True)
        await call(door_for(app, admission, readiness))
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
        await call(door_for(app, admission, starting))
        ready, other = await ready_pair(), App(take=True)
        await call(door_for(other, admission, ready), path="/v1/models", method="GET")
        await call(door_for(other, admission, ready), path=IMAGES, method="GET")
        return app.taken + other.taken, admission.in_flight

    assert asyncio.run(scenario()) == ([None, None, None], 0)


def test_what_the_door_cannot_decide_alone_goes_on_to_the_layers_behind_even_when_the_line_is_full():
    """A wrong or missing key (the gate's 401), a draining service (the drain gate's 503), the internal
    port (its 404): the door neither refuses nor places them."""

    async def scenario():
        readiness = await ready_pair()
        admission = RequestAdmission(max_queued=0, max_wait=60.0, metrics=ArMetrics(CollectorRegistry()))
        full(admission)
        app, draining = App(take=True), Drain(60.0)
        draining.begin()
        answers = [
            await call(door_for(app, admission, readiness), key=None),
            await call(door_for(app, admission, readiness), key="sk-wrong"),
            await call(door_for(app, admission, readiness, drain=draining)),
            await call(door_for(app, admission, readiness), port=INTERNAL_PORT),
        ]
        return [status for status, _, _ in answers], app.taken

    statuses, taken = asyncio.run(scenario())
    assert statuses == [200, 200, 200, 200]
    assert taken == [None, None, None, None]
