"""Connections that send no request are closed: a silent one and a slow head after the head timeout (a 408
when the head had begun), a head over the cap at once with 431; at the connection cap the oldest without a
complete head gives way to a new one; a body still trickling in past its deadline after its answer went out
is closed. What else comes after a complete head (a slow body within its deadline, a long answer, the next
request on the connection) is not the guard's to cut."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import uvloop
from fastapi import Request
from prometheus_client import CollectorRegistry

from services.connection_guard import ConnectionGuard
from services.metrics import Families
from tests.support.bare_app import bare_app
from tests.support.live_server import LiveServer
from tests.support.waiting import wait_for

HEAD_TIMEOUT = 1.0
MAX_HEAD = 4096
MAX_CONNECTIONS = 8
BODY_TIMEOUT = 3.0
HANG_GUARD = 30.0


@dataclass
class Served:
    server: LiveServer
    registry: CollectorRegistry

    def closed(self, reason: str) -> float:
        return self.registry.get_sample_value("ardit_t_connections_closed_total", {"reason": reason}) or 0.0

    def open(self) -> float:
        return self.registry.get_sample_value("ardit_t_connections_open") or 0.0

    def connect(self) -> socket.socket:
        client = socket.create_connection(("127.0.0.1", self.server.port), timeout=HANG_GUARD)
        return client


@pytest.fixture(params=["asyncio", "uvloop"])  # uvloop: what the services run on (uvicorn's loop="auto")
def guarded_server(request: pytest.FixtureRequest) -> Iterator[Served]:
    registry = CollectorRegistry()
    guard = ConnectionGuard(
        Families(registry, "t"),
        head_timeout=HEAD_TIMEOUT,
        max_head_bytes=MAX_HEAD,
        max_connections=MAX_CONNECTIONS,
        body_timeout=BODY_TIMEOUT,
    )
    app, _ = bare_app(registry, connections=guard)

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    @app.post("/early")
    async def early() -> dict[str, str]:  # answers without reading the body, as a 401 or 429 does
        return {"status": "early"}

    @app.get("/slow")
    async def slow(seconds: float) -> dict[str, str]:
        await asyncio.sleep(seconds)
        return {"status": "done"}

    server = LiveServer(
        app, loop_factory=uvloop.new_event_loop if request.param == "uvloop" else asyncio.new_event_loop
    )
    yield Served(server.start(), registry)
    server.stop()


def head(path: str = "/healthz", size: int | None = None, method: str = "GET", extra: str = "") -> bytes:
    """A request head of exactly ``size`` bytes (padded with a header) when given."""
    start = f"{method} {path} HTTP/1.1\r\nhost: t\r\n{extra}"
    end = "\r\n"
    if size is None:
        return (start + end).encode()
    padding = size - len(start) - len(end) - len("x-pad: \r\n")
    assert padding >= 0
    return (start + "x-pad: " + "p" * padding + "\r\n" + end).encode()


def answer(client: socket.socket) -> tuple[int, bytes]:
    """One answer's status and body; the connection stays open."""
    response = http.client.HTTPResponse(client)
    response.begin()
    return response.status, response.read()


def answers(client: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    while chunk := client.recv(65536):
        received += chunk
    return received


def status_and_body(answer: bytes) -> tuple[int, dict[str, object]]:
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def test_a_silent_connection_is_closed_without_an_answer(guarded_server):
    with guarded_server.connect() as client:
        assert answers(client) == b""
    assert guarded_server.closed("head_timeout") == 1


def test_a_head_that_never_ends_is_answered_408_and_closed(guarded_server):
    with guarded_server.connect() as client:
        client.sendall(b"GET /healthz HTTP/1.1\r\nhost: t\r\n")
        status, body = status_and_body(answers(client))
    assert status == 408 and body["error"]["code"] == "request_timeout"  # type: ignore[index]
    assert guarded_server.closed("head_timeout") == 1


def test_a_head_one_byte_over_the_cap_is_431_and_one_at_the_cap_is_served(guarded_server):
    with guarded_server.connect() as client:
        client.sendall(head(size=MAX_HEAD))
        assert answer(client)[0] == 200
    with guarded_server.connect() as client:
        client.sendall(head(size=MAX_HEAD + 1))
        status, body = status_and_body(answers(client))
    assert status == 431 and body["error"]["code"] == "request_header_fields_too_large"  # type: ignore[index]
    assert guarded_server.closed("head_too_large") == 1


def test_a_huge_header_is_cut_at_the_cap_not_read_to_its_end(guarded_server):
    with guarded_server.connect() as client:
        client.sendall(b"GET /healthz HTTP/1.1\r\nx-huge: ")
        sent = 0
        with pytest.raises(OSError):  # the server closes; the client's sends then fail
            while sent < 64 << 20:
                client.sendall(b"h" * 65536)
                sent += 65536
    assert sent < 64 << 20
    assert guarded_server.closed("head_too_large") == 1


def test_a_slow_body_and_a_long_answer_after_a_complete_head_are_not_cut(guarded_server):
    with guarded_server.connect() as client:
        client.sendall(head("/echo", method="POST", extra="content-length: 4\r\n"))
        for byte in b"abcd":
            time.sleep(HEAD_TIMEOUT / 2)
            client.sendall(bytes([byte]))
        assert answer(client) == (200, b'{"bytes":4}')
        client.sendall(head(f"/slow?seconds={2 * HEAD_TIMEOUT}"))
        assert answer(client) == (200, b'{"status":"done"}')
    assert guarded_server.closed("head_timeout") == 0


def test_a_body_trickling_in_after_an_early_answer_is_closed_at_its_deadline(guarded_server):
    with guarded_server.connect() as client:
        client.sendall(head("/early", method="POST", extra="content-length: 1000\r\n"))
        assert answer(client) == (200, b'{"status":"early"}')
        client.settimeout(0.5)
        closed = False
        for _ in range(int(HANG_GUARD / 0.5)):  # a byte every half second, until the server closes
            try:
                client.sendall(b"x")
                closed = client.recv(1) == b""
            except TimeoutError:
                continue
            except ConnectionError:
                closed = True
            if closed:
                break
    assert closed and guarded_server.closed("body_timeout") == 1


def test_a_slow_second_head_on_a_kept_alive_connection_is_closed_without_an_answer(guarded_server):
    with guarded_server.connect() as client:
        client.sendall(head())
        assert answer(client)[0] == 200
        client.sendall(b"GET /healthz HTTP/1.1\r\n")
        assert answers(client) == b""  # an answer here could land inside an earlier one's bytes
    assert guarded_server.closed("head_timeout") == 1


def test_at_the_cap_a_new_connection_closes_the_oldest_headless_one_and_busy_ones_stay(guarded_server):
    busy = guarded_server.connect()
    busy.sendall(head(f"/slow?seconds={HEAD_TIMEOUT / 2}"))
    idle = [guarded_server.connect() for _ in range(MAX_CONNECTIONS - 1)]
    wait_for(lambda: guarded_server.open() == MAX_CONNECTIONS, HANG_GUARD, "the server has accepted all of them")
    with guarded_server.connect() as newcomer:
        newcomer.sendall(head())
        assert answer(newcomer)[0] == 200
    assert answers(idle[0]) == b""  # the oldest headless one gave way
    assert answer(busy) == (200, b'{"status":"done"}')
    assert guarded_server.closed("evicted") >= 1
    for client in (busy, *idle):
        client.close()


def test_an_upgrade_request_is_served_as_a_plain_one_and_the_connection_stays_guarded(guarded_server):
    with guarded_server.connect() as client:
        client.sendall(head(extra="connection: upgrade\r\nupgrade: websocket\r\n"))
        assert answer(client)[0] == 200
        client.sendall(b"GET /healthz HTTP/1.1\r\n")  # then a head that never ends
        assert answers(client) == b""
    assert guarded_server.closed("head_timeout") == 1
