"""The image routes' door, in a real uvicorn server as ``services.serve`` runs it: a request takes its
admission place once its head is parsed; the line's refusals are written, counted, given an id and
logged together there, without a task or the app; a place nobody took is given back; and what the
door cannot decide alone goes on to the layers behind it."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import aiohttp
import httpx
import pytest
from aiohttp import web
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry
from starlette.types import Message, Receive, Scope, Send

from ar_service.admission import AdmissionPlace, RequestAdmission
from ar_service.api import admission_door
from ar_service.api.admission_door import (
    BURST_HOLD_SECONDS,
    BURST_QUIET_SECONDS,
    REFUSAL_LOG_SECONDS,
    AdmissionDoor,
    take_place,
)
from ar_service.dit_pool import DitPool
from ar_service.metrics import ArMetrics
from ar_service.readiness import ArReadiness
from services.app_metrics import AppMetrics
from services.auth import BearerAuth
from services.drain import Drain
from services.errors import ApiError
from tests.support.capabilities import DIT
from tests.support.fake_dit import fake_dit, ready
from tests.support.launched_pair import wait_for
from tests.support.live_server import LiveServer
from tests.support.ports import free_port

IMAGES = "/v1/images/generations"
KEY = "sk-door"
AUTH = {"authorization": f"Bearer {KEY}"}


async def ready_pair(engine_ready: bool = True) -> ArReadiness:
    """Readiness as the AR has it once its pool probed one ready DiT. The door reads only what that probe
    found, never probes itself: the stand-in DiT and the pool's session are closed once it has."""

    async def ready_dit(_: web.Request) -> web.Response:
        return ready()

    async with fake_dit(ready_dit) as dit:
        pool = DitPool(
            [dit.url],
            make_session=aiohttp.ClientSession,
            token="t",
            deadline_seconds=5.0,
            stall_seconds=5.0,
            hidden_size=DIT.hidden_size,
            layer=30,
            conditioning="qwen_image",
        )
        await pool.refresh()
        await pool.state()
        for replica in pool.replicas.values():
            await replica.session.close()
    return ArReadiness(pool, engine_ready=engine_ready)


@dataclass
class Behind:
    """What reached the app behind the door, and the places it took when told to take them."""

    take: bool = False
    calls: list[str] = field(default_factory=list)
    taken: list[AdmissionPlace | None] = field(default_factory=list)


@dataclass
class Served:
    server: LiveServer
    admission: RequestAdmission
    metrics: AppMetrics
    behind: Behind

    @property
    def url(self) -> str:
        return self.server.url

    def fill(self, free: int = 0) -> None:
        """Every slot but ``free`` taken, and no room left in line (``max_queued`` 0): once the free ones
        are taken, the next request is refused."""

        async def take_slots() -> None:
            for _ in range(DIT.capacity.max_outstanding - free):
                self.admission.enter(DIT.capacity.max_outstanding)

        self.server.call(take_slots())


@contextmanager
def served(
    *,
    max_queued: int = 0,
    engine_ready: bool = True,
    drain: Drain | None = None,
    internal: bool = False,
    take: bool = False,
    hold: float = 0.0,
    send_buffer_bytes: int | None = None,
) -> Iterator[Served]:
    """The door in front of a small app, served as the AR is served (``internal``: the server's own port
    is the AR's internal one; ``hold``: seconds the app takes over each request; ``send_buffer_bytes``: the
    kernel's send buffer of each connection)."""
    readiness = asyncio.run(ready_pair(engine_ready))
    admission = RequestAdmission(max_queued=max_queued, max_wait=60.0, metrics=ArMetrics(CollectorRegistry()))
    metrics, behind = AppMetrics(CollectorRegistry(), "ar"), Behind(take=take)
    app = FastAPI()

    @app.post(IMAGES)
    @app.get(IMAGES)
    @app.get("/v1/models")
    async def anything(request: Request) -> dict[str, str]:
        behind.calls.append(request.url.path)
        await asyncio.sleep(hold)
        if behind.take:
            behind.taken.append(take_place(request))
        return {}

    port = free_port()
    app.state.door = AdmissionDoor(
        admission=admission,
        readiness=readiness,
        paths=[IMAGES],
        auth=BearerAuth([KEY], what="API key", missing_code="missing_api_key", invalid_code="invalid_api_key"),
        drain=drain or Drain(60.0),
        metrics=metrics,
        internal_port=port if internal else None,
    )
    server = LiveServer(app, port, send_buffer_bytes).start()
    try:
        yield Served(server, admission, metrics, behind)
    finally:
        server.stop()


def raw(url: str, data: bytes, timeout: float = 3.0) -> bytes:
    """``data`` sent on one connection; everything the server answers until it closes the connection
    (within ``timeout``, less than uvicorn's 5 s keep-alive: a connection left open fails the read)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as connection:
        connection.sendall(data)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    return answer


def test_a_request_the_line_has_no_room_for_is_refused_at_the_door_counted_and_never_parsed():
    with served() as pair:
        pair.fill()
        answer = httpx.post(
            f"{pair.url}{IMAGES}", content=b"not even json", headers={**AUTH, "x-request-id": "req-from-client"}
        )
        assert answer.status_code == 429 and int(answer.headers["retry-after"]) >= 1
        assert answer.headers["x-request-id"] == "req-from-client"
        assert answer.json()["error"]["code"] == "rate_limit_exceeded"
        assert answer.json()["error"]["type"] == "rate_limit_error"
        assert pair.behind.calls == [] and pair.admission.in_flight == DIT.capacity.max_outstanding
        counted = {"route": IMAGES, "method": "POST", "status": "429"}
        assert pair.metrics.registry.get_sample_value("ardit_ar_http_requests_total", counted) == 1
        refusals = {"status": "429", "code": "rate_limit_exceeded"}
        assert pair.metrics.registry.get_sample_value("ardit_ar_api_errors_total", refusals) == 1


def test_a_refusal_keeps_a_kept_alive_connection_for_the_next_request_and_drops_the_refused_body():
    request = (
        f"POST {IMAGES} HTTP/1.1\r\nHost: ar\r\nAuthorization: Bearer {KEY}\r\nContent-Length: 5\r\n\r\nhello"
        "GET /v1/models HTTP/1.1\r\nHost: ar\r\nConnection: close\r\n\r\n"
    ).encode()
    with served() as pair:
        pair.fill()
        answer = raw(pair.url, request)
        assert answer.startswith(b"HTTP/1.1 429 ")
        assert answer.count(b"HTTP/1.1 ") == 2 and b"HTTP/1.1 200 OK" in answer
        assert pair.behind.calls == ["/v1/models"]


def test_a_refusal_closes_a_connection_its_client_asked_to_close():
    request = f"POST {IMAGES} HTTP/1.1\r\nHost: ar\r\nAuthorization: Bearer {KEY}\r\nConnection: close\r\n"
    with served() as pair:
        pair.fill()
        answer = raw(pair.url, f"{request}Content-Length: 2\r\n\r\n{{}}".encode())
    assert answer.startswith(b"HTTP/1.1 429 ") and b"\r\nconnection: close\r\n" in answer.lower()


def test_refusals_pipelined_behind_a_served_request_are_each_answered_in_turn():
    """Hundreds of requests queued behind one the app serves are refused one after another as uvicorn takes
    them off its queue: not one inside the other (Python's recursion limit), none lost."""
    post = f"POST {IMAGES} HTTP/1.1\r\nHost: ar\r\nAuthorization: Bearer {KEY}\r\nContent-Length: 2\r\n\r\n{{}}"
    close = "GET /v1/models HTTP/1.1\r\nHost: ar\r\nConnection: close\r\n\r\n"
    with served(hold=0.3) as pair:
        pair.fill(free=1)
        answer = raw(pair.url, (post * 600 + close).encode())
        assert answer.count(b"HTTP/1.1 200 OK") == 2 and answer.count(b"HTTP/1.1 429 ") == 599
        assert answer.index(b"HTTP/1.1 429 ") > answer.index(b"HTTP/1.1 200 OK")
        assert pair.behind.calls == [IMAGES, "/v1/models"]


@pytest.mark.slow
def test_a_request_right_behind_a_refusal_on_its_connection_is_not_cut_by_the_idle_timeout():
    """uvicorn closes a connection idle for 5 s after an answer; the request after a refusal, in the same
    bytes, is not idle time, however long the app takes over it."""
    request = (
        f"POST {IMAGES} HTTP/1.1\r\nHost: ar\r\nAuthorization: Bearer {KEY}\r\nContent-Length: 2\r\n\r\n{{}}"
        "GET /v1/models HTTP/1.1\r\nHost: ar\r\nConnection: close\r\n\r\n"
    ).encode()
    with served(hold=6.0) as pair:
        pair.fill()
        answer = raw(pair.url, request, timeout=10.0)
    assert answer.startswith(b"HTTP/1.1 429 ") and b"HTTP/1.1 200 OK" in answer


def test_requests_after_a_refusal_that_closed_the_connection_are_not_started():
    """A client waiting to send its body (``Expect: 100-continue``) has its connection closed with the
    refusal; what it sent after that on the connection is not served."""
    refused = f"POST {IMAGES} HTTP/1.1\r\nHost: ar\r\nAuthorization: Bearer {KEY}\r\nExpect: 100-continue\r\n"
    after = "GET /v1/models HTTP/1.1\r\nHost: ar\r\n\r\n"
    with served() as pair:
        pair.fill()
        answer = raw(pair.url, f"{refused}Content-Length: 2\r\n\r\n{{}}{after}".encode())
        assert answer.startswith(b"HTTP/1.1 429 ") and answer.count(b"HTTP/1.1 ") == 1
        assert pair.behind.calls == []


def test_a_client_that_stopped_reading_its_refusals_has_its_connection_closed_not_its_answers_queued():
    """Refusals written to a client that reads nothing fill the kernel's buffers, then the transport's; once
    the transport pauses writing, the next refusal closes the connection instead of queueing more answers
    in the server's memory for a reader that may never come."""
    pipelined = 2000
    post = f"POST {IMAGES} HTTP/1.1\r\nHost: ar\r\nAuthorization: Bearer {KEY}\r\nContent-Length: 2\r\n\r\n{{}}"
    with served(send_buffer_bytes=4096) as pair:
        pair.fill()
        host, port = pair.url.removeprefix("http://").split(":")
        connection = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        connection.settimeout(10.0)  # past uvicorn's 5 s keep-alive: a kept connection ends in EOF too
        with connection:
            connection.connect((host, int(port)))
            connection.sendall(post.encode() * pipelined)
            time.sleep(1.0)  # the server answers what it read while nothing is read here
            answer = b""
            try:
                while chunk := connection.recv(65536):
                    answer += chunk
            except ConnectionResetError:  # closed with requests it never read: what was read still counts
                pass
        refused = answer.count(b"HTTP/1.1 429 ")
        assert 0 < refused < pipelined and answer.count(b"HTTP/1.1 ") == refused
        assert pair.behind.calls == []
        assert httpx.get(f"{pair.url}/v1/models").status_code == 200  # the server goes on


def test_refusals_are_logged_together_not_one_line_each(caplog):
    with served() as pair, caplog.at_level(logging.WARNING, logger="ardit.ar.admission_door"):
        pair.fill()
        for _ in range(5):
            assert httpx.post(f"{pair.url}{IMAGES}", json={}, headers=AUTH).status_code == 429
        time.sleep(REFUSAL_LOG_SECONDS + 0.5)
    lines = [record.getMessage() for record in caplog.records if record.name == "ardit.ar.admission_door"]
    assert len(lines) == 1 and "refused 5 image request(s)" in lines[0] and "the queue is full" in lines[0]


async def door_with_one_slot(max_queued: int) -> AdmissionDoor:
    """The door of a ready pair with every slot but one taken and a line of ``max_queued``, keys off."""
    admission = RequestAdmission(max_queued=max_queued, max_wait=60.0, metrics=ArMetrics(CollectorRegistry()))
    for _ in range(DIT.capacity.max_outstanding - 1):
        admission.enter(DIT.capacity.max_outstanding)
    return AdmissionDoor(
        admission=admission,
        readiness=await ready_pair(),
        paths=[IMAGES],
        auth=BearerAuth([], what="API key", missing_code="missing_api_key", invalid_code="invalid_api_key"),
        drain=Drain(60.0),
        metrics=AppMetrics(CollectorRegistry(), "ar"),
        internal_port=None,
    )


async def disconnected() -> Message:
    return {"type": "http.disconnect"}


async def ignored(message: Message) -> None:
    pass


def test_admitted_requests_go_on_to_their_work_one_per_loop_pass_so_a_refusal_waits_behind_at_most_one():
    """Refusals are written as their bytes are read, between loop passes; here they are read two passes
    after four admitted requests: one of those may have done its work by then, not all four."""

    async def scenario() -> list[object]:
        door = await door_with_one_slot(max_queued=3)  # one slot free, and a line of three
        events: list[object] = []

        async def work(scope: Scope, receive: Receive, send: Send) -> None:
            events.append("work")
            take_place(Request(scope))  # kept: the line stays as full as it was

        def arrive() -> tuple[int, Scope] | None:
            scope: Scope = {"type": "http", "method": "POST", "path": IMAGES, "headers": [], "state": {}}
            entered = door.enter(scope)
            if isinstance(entered, ApiError):
                events.append(entered.status)  # written at once, where the door reads it
                return None
            scope["state"]["admission_place"] = entered
            return door.arrivals, scope

        arrived = [scope for scope in (arrive() for _ in range(4)) if scope is not None]
        admitted = [
            asyncio.create_task(door.go_on(work, arrival, scope, disconnected, ignored)) for arrival, scope in arrived
        ]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        for _ in range(3):
            assert arrive() is None
        await asyncio.gather(*admitted)
        return events

    events = asyncio.run(scenario())
    assert events[: events.index(429)].count("work") <= 1
    assert events.count(429) == 3 and events[-1] != 429
    assert events.count("work") == 4


async def door_in_a_burst(
    arriving_seconds: float, until_work: bool = False
) -> tuple[list[tuple[str, float]], float, float]:
    """One admitted request, then an arrival every loop pass (each refused: the pair is full and there is no
    line) for ``arriving_seconds``, or, ``until_work``, until the admitted request's work has started. What
    happened, with when (``work``, ``refused``), and the first and last arrivals' times."""
    door = await door_with_one_slot(max_queued=0)
    events: list[tuple[str, float]] = []

    async def work(scope: Scope, receive: Receive, send: Send) -> None:
        events.append(("work", time.monotonic()))
        take_place(Request(scope))  # kept: the pair stays full

    def arrive() -> AdmissionPlace | ApiError | None:
        return door.enter({"type": "http", "method": "POST", "path": IMAGES, "headers": [], "state": {}})

    place = arrive()
    assert isinstance(place, AdmissionPlace)
    scope: Scope = {
        "type": "http",
        "method": "POST",
        "path": IMAGES,
        "headers": [],
        "state": {"admission_place": place},
    }
    admitted = asyncio.create_task(door.go_on(work, door.arrivals, scope, disconnected, ignored))
    first = last = time.monotonic()
    while time.monotonic() - first < arriving_seconds and not (
        until_work and any(what == "work" for what, _ in events)
    ):
        await asyncio.sleep(0)
        assert isinstance(arrive(), ApiError)
        last = time.monotonic()
        events.append(("refused", last))
    await admitted
    return events, first, last


def test_an_admitted_request_nobody_came_after_goes_on_at_once():
    """Its work starts within loop passes, with no wait for a quiet door."""

    async def scenario() -> list[tuple[str, float]]:
        door = await door_with_one_slot(max_queued=0)
        place = door.enter({"type": "http", "method": "POST", "path": IMAGES, "headers": [], "state": {}})
        worked: list[tuple[str, float]] = []

        async def work(scope: Scope, receive: Receive, send: Send) -> None:
            worked.append(("work", time.monotonic()))

        scope: Scope = {"type": "http", "method": "POST", "path": IMAGES, "headers": [], "state": {}}
        scope["state"]["admission_place"] = place
        task = asyncio.create_task(door.go_on(work, door.arrivals, scope, disconnected, ignored))
        for _ in range(3):
            await asyncio.sleep(0)
        assert task.done()
        return worked

    assert [what for what, _ in asyncio.run(scenario())] == ["work"]


def test_the_work_a_burst_admits_waits_until_the_burst_is_answered(monkeypatch):
    """Arrivals every loop pass for 5 ms: the admitted request's work starts after the last of them, once the
    door has been quiet. The hold's cap is lifted here (a loaded machine's pause would reach it); the next
    test checks it."""
    monkeypatch.setattr(admission_door, "BURST_HOLD_SECONDS", 60.0)
    events, _, last = asyncio.run(door_in_a_burst(arriving_seconds=0.005))
    assert [what for what, _ in events][-1] == "work"
    assert events[-1][1] - last >= BURST_QUIET_SECONDS


def test_a_flood_that_never_pauses_still_lets_admitted_work_through():
    """Arrivals every loop pass until the work starts, or for 100 holds: it starts while they go on."""
    events, first, last = asyncio.run(door_in_a_burst(arriving_seconds=100 * BURST_HOLD_SECONDS, until_work=True))
    worked = next(when for what, when in events if what == "work")
    assert worked <= last < first + 100 * BURST_HOLD_SECONDS  # the flood ended because the work started


def test_a_place_the_app_did_not_take_is_given_back_when_the_request_ends():
    with served(max_queued=4) as pair:
        assert httpx.post(f"{pair.url}{IMAGES}", json={}, headers=AUTH).status_code == 200
        assert pair.behind.calls == [IMAGES]
        wait_for(lambda: pair.admission.in_flight == 0, 2.0, "the place is given back once the request ends")


def test_a_place_the_app_took_is_the_apps_to_turn_into_a_slot():
    with served(max_queued=4, take=True) as pair:
        assert httpx.post(f"{pair.url}{IMAGES}", json={}, headers=AUTH).status_code == 200
        in_flight_after_the_request = pair.admission.in_flight
        place = pair.behind.taken[0]
        assert place is not None

        async def serve_it() -> None:
            ticket = await place.turn()
            ticket.release(served=True)

        pair.server.call(serve_it())
        assert (in_flight_after_the_request, pair.admission.in_flight) == (1, 0)


@pytest.mark.parametrize("engine_ready", [False, True])
def test_before_the_pair_is_known_ready_and_off_the_image_routes_requests_pass_without_a_place(engine_ready):
    with served(engine_ready=engine_ready, take=True) as pair:
        if not engine_ready:
            assert httpx.post(f"{pair.url}{IMAGES}", json={}, headers=AUTH).status_code == 200
        assert httpx.get(f"{pair.url}/v1/models", headers=AUTH).status_code == 200
        assert httpx.get(f"{pair.url}{IMAGES}", headers=AUTH).status_code == 200
        assert all(place is None for place in pair.behind.taken) and pair.behind.taken
        assert pair.admission.in_flight == 0


@pytest.mark.parametrize("why", ["no key", "a wrong key", "draining", "the internal port"])
def test_what_the_door_cannot_decide_alone_goes_on_to_the_layers_behind_even_when_the_line_is_full(why):
    """A wrong or missing key (the gate's 401), a draining service (the drain gate's 503), the internal
    port (its 404): the door neither refuses nor places them."""
    draining = Drain(60.0)
    if why == "draining":
        draining.begin()
    headers = {"no key": {}, "a wrong key": {"authorization": "Bearer sk-wrong"}}.get(why, AUTH)
    with served(drain=draining, internal=why == "the internal port", take=True) as pair:
        pair.fill()
        assert httpx.post(f"{pair.url}{IMAGES}", json={}, headers=headers).status_code == 200
        assert pair.behind.taken == [None]
