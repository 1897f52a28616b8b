"""A client that stops reading is cut off after the send timeout, and counted; a slow one that keeps
reading is never cut; answers waiting on stalled readers are bounded in number."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from fastapi import Response
from prometheus_client import CollectorRegistry

from services.metrics import Families
from services.slow_readers import SlowReaders
from tests.support.bare_app import bare_app
from tests.support.live_server import LiveServer
from tests.support.waiting import wait_for

ANSWER_BYTES = 32 << 20  # far more than the socket buffers between the server and a stalled client
SEND_TIMEOUT = 1.0


@dataclass
class Served:
    server: LiveServer
    registry: CollectorRegistry

    def value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(f"ardit_t_{name}", labels) or 0.0


@pytest.fixture
def big_answers() -> Iterator[Served]:
    registry = CollectorRegistry()
    guard = SlowReaders(Families(registry, "t"), send_timeout=SEND_TIMEOUT, max_responses=2, max_bytes=1 << 30)
    app, _ = bare_app(registry, slow_readers=guard)

    @app.get("/big")
    async def big(size: int = ANSWER_BYTES) -> Response:
        return Response(b"x" * size, media_type="application/octet-stream")

    server = LiveServer(app).start()
    yield Served(server, registry)
    server.stop()


def ask(server: LiveServer, size: int = ANSWER_BYTES, receive_buffer: int = 4096) -> socket.socket:
    """A GET /big of ``size`` bytes from a socket with a small receive buffer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(f"GET /big?size={size} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
    return sock


def read_all(sock: socket.socket, pause: float = 0.0) -> int:
    total = 0
    sock.settimeout(10)
    try:
        while chunk := sock.recv(1 << 20):
            total += len(chunk)
            time.sleep(pause)
    except ConnectionResetError:
        pass
    return total


def test_a_client_that_stops_reading_is_cut_off_after_the_send_timeout(big_answers):
    sock = ask(big_answers.server)
    wait_for(lambda: big_answers.value("slow_readers") == 1)
    stalled_at = time.monotonic()
    assert big_answers.value("slow_reader_bytes") > 0
    wait_for(lambda: big_answers.value("slow_readers_closed_total", reason="send_timeout") == 1)
    assert time.monotonic() - stalled_at >= SEND_TIMEOUT * 0.9
    assert read_all(sock) < ANSWER_BYTES  # what was in flight, then the reset
    assert big_answers.value("slow_readers") == 0 and big_answers.value("slow_reader_bytes") == 0


def test_a_slow_client_that_keeps_reading_gets_its_whole_answer(big_answers):
    size = 16 << 20  # beyond the kernel's socket buffers (4 MB at most here): the rest waits in the transport
    sock = ask(big_answers.server, size, receive_buffer=16384)
    sock.settimeout(10)
    started, received, most_paused = time.monotonic(), 0, 0.0
    while chunk := sock.recv(16384):  # at most 1.6 MB/s: the answer takes several send timeouts to read
        received += len(chunk)
        most_paused = max(most_paused, big_answers.value("slow_readers"))
        time.sleep(0.01)
        if received > size:
            break
    took = time.monotonic() - started
    assert received > size and most_paused == 1  # all of it, though its connection was paused
    assert took > 2 * SEND_TIMEOUT and big_answers.value("slow_readers_closed_total", reason="send_timeout") == 0


def test_answers_waiting_on_stalled_readers_are_bounded_in_number(big_answers):
    first, second = ask(big_answers.server), ask(big_answers.server)
    wait_for(lambda: big_answers.value("slow_readers") == 2)
    third = ask(big_answers.server)
    wait_for(lambda: big_answers.value("slow_readers_closed_total", reason="too_many_waiting") == 1)
    assert read_all(third) < ANSWER_BYTES and big_answers.value("slow_readers") == 2
    for sock in (first, second, third):
        sock.close()
