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

ANSWER_BYTES = 32 << 20  # far more than the socket buffers between the server and a stalled client
SEND_TIMEOUT = 1.0


@dataclass
class Served:
    server: LiveServer
    registry: CollectorRegistry

    def value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(f"ardit_t_{name}", labels) or 0.0


@pytest.fixture
def served() -> Iterator[Served]:
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


def wait_until(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)


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


def test_a_client_that_stops_reading_is_cut_off_after_the_send_timeout(served):
    sock = ask(served.server)
    wait_until(lambda: served.value("slow_readers") == 1, 10)
    stalled_at = time.monotonic()
    assert served.value("slow_reader_bytes") > 0
    wait_until(lambda: served.value("slow_readers_closed_total", reason="send_timeout") == 1, SEND_TIMEOUT + 5)
    assert time.monotonic() - stalled_at >= SEND_TIMEOUT * 0.9
    assert read_all(sock) < ANSWER_BYTES  # what was in flight, then the reset
    assert served.value("slow_readers") == 0 and served.value("slow_reader_bytes") == 0


def test_a_slow_client_that_keeps_reading_gets_its_whole_answer(served):
    size = 16 << 20  # beyond the kernel's socket buffers (4 MB at most here): the rest waits in the transport
    sock = ask(served.server, size, receive_buffer=16384)
    sock.settimeout(10)
    started, received, most_paused = time.monotonic(), 0, 0.0
    while chunk := sock.recv(16384):  # at most 1.6 MB/s: the answer takes several send timeouts to read
        received += len(chunk)
        most_paused = max(most_paused, served.value("slow_readers"))
        time.sleep(0.01)
        if received > size:
            break
    took = time.monotonic() - started
    assert received > size and most_paused == 1  # all of it, though its connection was paused
    assert took > 2 * SEND_TIMEOUT and served.value("slow_readers_closed_total", reason="send_timeout") == 0


def test_answers_waiting_on_stalled_readers_are_bounded_in_number(served):
    first, second = ask(served.server), ask(served.server)
    wait_until(lambda: served.value("slow_readers") == 2, 10)
    third = ask(served.server)
    wait_until(lambda: served.value("slow_readers_closed_total", reason="too_many_waiting") == 1, 5)
    assert read_all(third) < ANSWER_BYTES and served.value("slow_readers") == 2
    for sock in (first, second, third):
        sock.close()
