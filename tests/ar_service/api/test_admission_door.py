"""The image routes' door, the AR's outermost ASGI layer, in a real uvicorn server as ``services.serve`` runs it:
a request takes its admission place as it arrives; the line's refusals are written, counted, given an id and
logged together there, before the app; a request before the pair is known ready waits for the probe and is
answered 503 if it is not; a place nobody took is given back; and what the door cannot decide alone goes on
to the layers behind it."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import aiohttp
import httpx
import pytest
from aiohttp import web
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ar_service.admission import AdmissionPlace, RequestAdmission
from ar_service.api.admission_door import BURST_ARRIVALS, QUIET_PASSES, AdmissionDoor, take_place
from ar_service.dit_pool import DitPool
from ar_service.metrics import ArMetrics
from ar_service.readiness import ArReadiness
from benchmarks.paired import BackgroundLoad
from services.app_metrics import AppMetrics
from services.auth import BearerAuth
from services.drain import Drain
from services.metrics import Families
from services.slow_readers import SlowReaders
from shared.capabilities import Load
from shared.row_recipe import RowRecipe
from tests.support.capabilities import DIT
from tests.support.fake_dit import fake_dit, ready
from tests.support.launched_pair import wait_for
from tests.support.live_server import LiveServer
from tests.support.ports import free_port
from tests.support.waiting import HANG_GUARD

# What a request taking a place at the door is priced at before any request was read: the DiTs' default one.
DEFAULT_LOAD = Load.of(DIT.defaults.params())

IMAGES = "/v1/images/generations"
KEY = "sk-door"
AUTH = {"authorization": f"Bearer {KEY}"}
# The burst tests/e2e/test_load.py sent `make run`'s pair on 2026-12-04: three times what it served within its
# longest wait (benchmarks/door_burst.py's larger burst).
BURST = 783


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
            rows=RowRecipe(layers=[30]),
            row_width=DIT.row_width,
        )
        await pool.refresh()
        await pool.state()
        for replica in pool.replicas.values():
            await replica.session.close()
    return ArReadiness(pool, engine_ready=engine_ready)


@dataclass
class Behind:
    """What reached the app behind the door, the door's refusals so far as each call began, and the places it
    took when told to take them."""

    take: bool = False
    calls: list[str] = field(default_factory=list)
    refused_before: list[float] = field(default_factory=list)
    taken: list[AdmissionPlace | None] = field(default_factory=list)


@dataclass
class Served:
    server: LiveServer
    admission: RequestAdmission
    metrics: AppMetrics
    behind: Behind
    guard: CollectorRegistry  # the slow-readers guard's metrics

    @property
    def url(self) -> str:
        return self.server.url

    def fill(self, free: int = 0) -> None:
        """Every slot but ``free`` taken, and no room left in line (``max_queued`` 0): once the free ones
        are taken, the next request is refused."""

        async def take_slots() -> None:
            for _ in range(DIT.capacity.max_outstanding - free):
                self.admission.enter(DIT.capacity.max_outstanding, DEFAULT_LOAD)

        self.server.call(take_slots())


def door_kwargs(
    admission: RequestAdmission, readiness: ArReadiness, metrics: AppMetrics, *, keys: list[str], **overrides
) -> dict:
    return {
        "admission": admission,
        "readiness": readiness,
        "paths": [IMAGES],
        "auth": BearerAuth(keys, what="API key", missing_code="missing_api_key", invalid_code="invalid_api_key"),
        "drain": Drain(60.0),
        "metrics": metrics,
        "internal_port": None,
    } | overrides


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
    send_timeout: float | None = None,
) -> Iterator[Served]:
    """The door in front of a small app, served as the AR is served (``internal``: the server's own port
    is the AR's internal one; ``hold``: seconds the app takes over each request; ``send_buffer_bytes``: the
    kernel's send buffer of each connection; ``send_timeout``: a slow-readers guard with that timeout)."""
    readiness = asyncio.run(ready_pair(engine_ready))
    admission = RequestAdmission(max_queued=max_queued, max_wait=60.0, metrics=ArMetrics(CollectorRegistry()))
    metrics, behind = AppMetrics(CollectorRegistry(), "ar"), Behind(take=take)
    app = FastAPI()

    @app.post(IMAGES)
    @app.get(IMAGES)
    @app.get("/v1/models")
    async def anything(request: Request) -> dict[str, str]:
        behind.calls.append(request.url.path)
        behind.refused_before.append(refused(metrics))
        await asyncio.sleep(hold)
        if behind.take:
            behind.taken.append(request.scope.get("state", {}).get("admission_place"))
            if behind.taken[-1] is not None:
                take_place(request)
        return {}

    port = free_port()
    app.add_middleware(
        AdmissionDoor,
        **door_kwargs(
            admission,
            readiness,
            metrics,
            keys=[KEY],
            drain=drain or Drain(60.0),
            internal_port=port if internal else None,
        ),
    )
    guard = CollectorRegistry()
    if send_timeout is not None:
        app.state.slow_readers = SlowReaders(
            Families(guard, "t"), send_timeout=send_timeout, max_responses=64, max_bytes=1 << 30
        )
    server = LiveServer(app, port, send_buffer_bytes).start()
    try:
        yield Served(server, admission, metrics, behind, guard)
    finally:
        server.stop()


def refused(metrics: AppMetrics) -> float:
    """Image requests the door has refused so far, as it counts them."""
    counted = {"route": IMAGES, "method": "POST", "status": "429"}
    return metrics.registry.get_sample_value("ardit_ar_http_requests_total", counted) or 0.0


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


def test_refusals_pipelined_on_one_connection_are_each_answered_in_turn():
    """Hundreds of requests sent at once on one connection are refused one after another, none lost, and the
    request after them is served (the server takes a connection's requests one at a time)."""
    post = f"POST {IMAGES} HTTP/1.1\r\nHost: ar\r\nAuthorization: Bearer {KEY}\r\nContent-Length: 2\r\n\r\n{{}}"
    close = "GET /v1/models HTTP/1.1\r\nHost: ar\r\nConnection: close\r\n\r\n"
    with served() as pair:
        pair.fill()
        answer = raw(pair.url, (post * 600 + close).encode(), timeout=60.0)
        assert answer.count(b"HTTP/1.1 429 ") == 600 and answer.count(b"HTTP/1.1 200 OK") == 1
        assert answer.index(b"HTTP/1.1 200 OK") > answer.rindex(b"HTTP/1.1 429 ")
        assert pair.behind.calls == ["/v1/models"]


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


def test_a_client_waiting_to_send_its_body_is_refused_with_the_connection_closed():
    """A client waiting to send its body (``Expect: 100-continue``) has its connection closed with the
    refusal: what it sent after that on the connection is not served."""
    refused = f"POST {IMAGES} HTTP/1.1\r\nHost: ar\r\nAuthorization: Bearer {KEY}\r\nExpect: 100-continue\r\n"
    after = "GET /v1/models HTTP/1.1\r\nHost: ar\r\n\r\n"
    with served() as pair:
        pair.fill()
        answer = raw(pair.url, f"{refused}Content-Length: 2\r\n\r\n{{}}{after}".encode())
        assert answer.startswith(b"HTTP/1.1 429 ") and answer.count(b"HTTP/1.1 ") == 1
        assert b"\r\nconnection: close\r\n" in answer.lower() and pair.behind.calls == []


def cut(pair: Served) -> float:
    return pair.guard.get_sample_value("ardit_t_slow_readers_closed_total", {"reason": "send_timeout"}) or 0.0


def test_a_client_that_stopped_reading_its_refusals_is_cut_off_not_answered_without_end():
    """Refusals written to a client that reads nothing fill the kernel's buffers, then the transport's; the next
    refusal waits like any answer, and the slow-readers guard cuts the client off after its send timeout
    instead of queueing answers for a reader that may never come."""
    pipelined = 2000
    post = f"POST {IMAGES} HTTP/1.1\r\nHost: ar\r\nAuthorization: Bearer {KEY}\r\nContent-Length: 2\r\n\r\n{{}}"
    with served(send_buffer_bytes=4096, send_timeout=0.5) as pair:
        pair.fill()
        host, port = pair.url.removeprefix("http://").split(":")
        connection = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        connection.settimeout(30.0)  # a hang guard
        with connection:
            connection.connect((host, int(port)))
            connection.sendall(post.encode() * pipelined)
            wait_for(lambda: cut(pair) == 1, 30, "the client is cut off")
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
        wait_for(lambda: any(r.name == "ardit.ar.admission_door" for r in caplog.records), 30, "the log line")
    lines = [record.getMessage() for record in caplog.records if record.name == "ardit.ar.admission_door"]
    assert len(lines) == 1 and "refused 5 image request(s)" in lines[0] and "the queue is full" in lines[0]


async def door_with_one_slot(max_queued: int, app: ASGIApp) -> AdmissionDoor:
    """The door of a ready pair with every slot but one taken and a line of ``max_queued``, keys off, before
    ``app``."""
    admission = RequestAdmission(max_queued=max_queued, max_wait=60.0, metrics=ArMetrics(CollectorRegistry()))
    for _ in range(DIT.capacity.max_outstanding - 1):
        admission.enter(DIT.capacity.max_outstanding, DEFAULT_LOAD)
    metrics = AppMetrics(CollectorRegistry(), "ar")
    return AdmissionDoor(app, **door_kwargs(admission, await ready_pair(), metrics, keys=[]))


async def disconnected() -> Message:
    return {"type": "http.disconnect"}


def image_request() -> Scope:
    return {"type": "http", "method": "POST", "path": IMAGES, "headers": [], "state": {}}


class Events(list):
    """What happened, in order: ``work`` when the app behind started a request, the status of each answer the
    door wrote itself."""

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.append(message["status"])

    async def work(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.append("work")
        take_place(Request(scope))  # kept: the line stays as full as it was


class Passes:
    """The event loop's passes, counted by a task that yields once a pass while it runs."""

    def __init__(self) -> None:
        self.count = 0
        self._task = asyncio.ensure_future(self._count())

    async def _count(self) -> None:
        while True:
            await asyncio.sleep(0)
            self.count += 1

    def stop(self) -> None:
        self._task.cancel()


def test_a_burst_is_answered_before_its_admitted_requests_go_on_one_per_loop_pass():
    """Four requests admitted (the free slot and a line of three), then three refused two passes later: the three
    are answered before any of the four's work starts, and the four then start in four different passes."""

    async def scenario() -> tuple[Events, list[int]]:
        events, started_in = Events(), []

        async def work(scope: Scope, receive: Receive, send: Send) -> None:
            started_in.append(passes.count)
            await events.work(scope, receive, send)

        door = await door_with_one_slot(max_queued=3, app=work)
        passes = Passes()
        arrive = [asyncio.create_task(door(image_request(), disconnected, events.send)) for _ in range(4)]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        arrive += [asyncio.create_task(door(image_request(), disconnected, events.send)) for _ in range(3)]
        await asyncio.gather(*arrive)
        passes.stop()
        return events, started_in

    events, started_in = asyncio.run(scenario())
    assert events == [429] * 3 + ["work"] * 4
    assert started_in == sorted(set(started_in))


async def door_in_a_burst(passes: int | None) -> tuple[Events, int]:
    """One admitted request, then an arrival every loop pass (each refused: the pair is full and there is no
    line) for ``passes`` passes, or, with None, until the admitted request's work has started. What happened,
    and how many arrived after the admitted one."""
    events = Events()
    door = await door_with_one_slot(max_queued=0, app=events.work)
    admitted = asyncio.create_task(door(image_request(), disconnected, events.send))
    refused = 0
    while refused != passes and refused < 100 * BURST_ARRIVALS:  # a hang guard, for a door that never opens
        await asyncio.sleep(0)
        if passes is None and "work" in events:
            break
        await door(image_request(), disconnected, events.send)
        refused += 1
    await admitted
    return events, refused


def test_an_admitted_request_nobody_came_after_goes_on_once_the_door_was_quiet_a_few_passes():
    """Its work starts as soon as the door has seen no arrival for QUIET_PASSES loop passes, with no clock
    involved."""

    async def scenario() -> tuple[int, Events]:
        events = Events()
        door = await door_with_one_slot(max_queued=0, app=events.work)
        task = asyncio.create_task(door(image_request(), disconnected, events.send))
        passes = 0
        while not task.done() and passes <= 10 * QUIET_PASSES:
            await asyncio.sleep(0)
            passes += 1
        return passes, events

    passes, events = asyncio.run(scenario())
    assert events == ["work"] and QUIET_PASSES <= passes <= QUIET_PASSES + 2


@pytest.fixture
def busy_cores() -> Iterator[None]:
    """Every core kept busy by a process that spins, as the benchmarks' background load does: a pass of the
    event loop may then wait for a core far longer than it takes."""
    load = BackgroundLoad(len(os.sched_getaffinity(0)))
    load.start()
    try:
        yield
    finally:
        load.stop()


def test_the_work_a_burst_admits_waits_until_the_burst_is_answered_with_every_core_busy(busy_cores):
    """An arrival every loop pass, as many as tests/e2e/test_load.py's burst, with every core busy: the admitted
    request's work starts after the last of them, however long the machine pauses between two passes."""
    events, refused = asyncio.run(door_in_a_burst(passes=BURST))
    assert events == [429] * BURST + ["work"] and refused == BURST


def test_a_flood_that_never_pauses_still_lets_admitted_work_through():
    """An arrival every loop pass for as long as the admitted request's work has not started: it starts once
    BURST_ARRIVALS requests have reached the door after it, while the flood goes on."""
    events, refused = asyncio.run(door_in_a_burst(passes=None))
    assert events == [429] * refused + ["work"] and BURST_ARRIVALS <= refused <= BURST_ARRIVALS + 1


def connected(url: str) -> socket.socket:
    """A connection to the server at ``url``, its send buffer large enough for a burst's requests."""
    host, port = url.removeprefix("http://").split(":")
    connection = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    connection.settimeout(HANG_GUARD)
    connection.connect((host, int(port)))
    return connection


def read_to_the_end(connection: socket.socket) -> bytes:
    answer = b""
    while chunk := connection.recv(65536):
        answer += chunk
    return answer


@contextmanager
def held(server: LiveServer) -> Iterator[None]:
    """The server's event loop held in one callback: whatever is written meanwhile reaches it in its next pass."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(HANG_GUARD)

    server.loop.call_soon_threadsafe(hold)
    assert holding.wait(HANG_GUARD), "the server's loop is held"
    try:
        yield
    finally:
        release.set()


def test_a_burst_reaching_the_door_a_loop_pass_apart_is_answered_before_the_work_it_admits_with_every_core_busy(
    busy_cores,
):
    """A real server with one slot free, every core busy. One request, then the burst's others pipelined on a
    second connection (the server takes a connection's requests one at a time, so they reach the door a pass
    apart), written while the server's loop is held: the first takes the slot, and its work starts after the
    last of the others is refused."""
    post = f"POST {IMAGES} HTTP/1.1\r\nHost: ar\r\nAuthorization: Bearer {KEY}\r\nContent-Length: 2\r\n"
    last = f"{post}Connection: close\r\n\r\n{{}}".encode()
    with served() as pair:
        pair.fill(free=1)
        with connected(pair.url) as admitted, connected(pair.url) as burst:
            with held(pair.server):
                admitted.sendall(last)
                burst.sendall(f"{post}\r\n{{}}".encode() * (BURST - 2) + last)
            refusals = read_to_the_end(burst)
            answer = read_to_the_end(admitted)
        assert answer.startswith(b"HTTP/1.1 200 ") and refusals.count(b"HTTP/1.1 429 ") == BURST - 1
        assert pair.behind.refused_before == [BURST - 1]


def test_a_place_the_app_did_not_take_is_given_back_when_the_request_ends():
    with served(max_queued=4) as pair:
        assert httpx.post(f"{pair.url}{IMAGES}", json={}, headers=AUTH).status_code == 200
        assert pair.behind.calls == [IMAGES]
        wait_for(lambda: pair.admission.in_flight == 0, 30, "the place is given back once the request ends")


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


def test_a_place_taken_at_the_door_is_its_api_keys_from_arrival():
    """The key's tenant, as the gate behind names it: the line knows whose turn a place waits for before its body is
    read."""
    tenant = BearerAuth([KEY], what="API key", missing_code="m", invalid_code="i").check(AUTH["authorization"])
    with served(max_queued=4, take=True) as pair:
        assert httpx.post(f"{pair.url}{IMAGES}", json={}, headers=AUTH).status_code == 200
        place = pair.behind.taken[0]
        assert place is not None and place.tenant == tenant and not place.priced


def test_a_place_is_priced_as_the_default_until_a_request_was_read_then_as_the_requests_read_asked():
    read = Load(1, DEFAULT_LOAD.megapixels / 4, DEFAULT_LOAD.work / 4)  # lighter than the default
    with served(max_queued=4, take=True) as pair:
        assert httpx.post(f"{pair.url}{IMAGES}", json={}, headers=AUTH).status_code == 200
        first = pair.behind.taken[0]
        assert first is not None and first.load == DEFAULT_LOAD

        async def read_and_serve(place: AdmissionPlace) -> None:
            place.price(read)
            (await place.turn()).release(served=True)

        pair.server.call(read_and_serve(first))
        assert httpx.post(f"{pair.url}{IMAGES}", json={}, headers=AUTH).status_code == 200
        second = pair.behind.taken[1]
        assert second is not None and second.load == read
        pair.server.call(read_and_serve(second))


def test_a_request_before_the_pair_is_ready_is_answered_503_at_the_door_and_other_routes_pass_without_a_place():
    with served(engine_ready=False, take=True) as pair:
        answer = httpx.post(f"{pair.url}{IMAGES}", json={}, headers=AUTH)
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "not_ready"
        assert int(answer.headers["retry-after"]) >= 1 and pair.behind.calls == []
        assert httpx.get(f"{pair.url}/v1/models", headers=AUTH).status_code == 200
        assert httpx.get(f"{pair.url}{IMAGES}", headers=AUTH).status_code == 200
        assert pair.behind.taken == [None, None] and pair.admission.in_flight == 0


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
