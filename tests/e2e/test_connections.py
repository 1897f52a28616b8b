"""Connections at the defaults: thousands of silent connections and of request heads sent a byte at a time
are all closed by the head deadline while a real client is served; so are hundreds of bodies sent a byte at a time
after their request was answered 401 without them; a head one byte past the cap is a 431 on both services, one at
the cap is served."""

from __future__ import annotations

import asyncio
import concurrent.futures
import resource
import socket

import httpx
import pytest

from services.settings import HEAD_BYTES
from tests.conftest import API_KEY
from tests.e2e.metrics_text import sample

pytestmark = pytest.mark.slow

HELD = 2000  # of each kind
TRICKLE_SECONDS = 1.0  # a slow head's pace: one byte a second, for as long as the server keeps it
HANG_GUARD = 180.0


async def held(
    port: int, slow: bool, start: bytes = b"POST /v1/images/generations HTTP/1.1\r\nhost: ardit\r\nx-slow: "
) -> bytes:
    """A connection that sends ``start`` and then a byte at a time (or, not ``slow``, nothing) and never completes
    its request: what the server sent before closing it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if slow:
            writer.write(start)
        received = b""
        while True:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), TRICKLE_SECONDS)
            except TimeoutError:
                if slow:
                    writer.write(b"s")
                continue
            except ConnectionError:
                return received
            if not chunk:
                return received
            received += chunk
    finally:
        writer.close()


def held_of_each_kind() -> int:
    """Each connection takes two of this process's files (the client's and the in-process AR's, whose start raised
    the limit): a machine whose limit is lower holds fewer, all within the AR's connection cap, so that none is
    closed to make room instead."""
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    each = min(HELD, (files - 2048) // 4)
    assert each >= 500, f"an open-file limit of {files} is too low for this test"
    return each


async def hold_all(port: int, each: int, meanwhile: concurrent.futures.Future[tuple[int, int]]) -> list[bytes]:
    connections = [asyncio.ensure_future(held(port, slow=i % 2 == 1)) for i in range(2 * each)]
    await asyncio.sleep(TRICKLE_SECONDS)  # all opened, the slow ones begun
    assert not any(connection.done() for connection in connections)
    meanwhile.set_result(await asyncio.to_thread(real_client, port))
    return list(await asyncio.wait_for(asyncio.gather(*connections), HANG_GUARD))


def real_client(port: int) -> tuple[int, int]:
    base = f"http://127.0.0.1:{port}"
    health = httpx.get(f"{base}/healthz", timeout=HANG_GUARD)
    image = httpx.post(
        f"{base}/v1/images/generations",
        json={"prompt": "a red square", "size": "64x64", "num_inference_steps": 2},
        headers={"authorization": f"Bearer {API_KEY}"},
        timeout=HANG_GUARD,
    )
    return health.status_code, image.status_code


def test_thousands_of_silent_and_slow_connections_are_closed_while_a_real_client_is_served(stack):
    closed_before = sample(stack.ar.url, "ardit_ar_connections_closed_total", reason="head_timeout")
    meanwhile: concurrent.futures.Future[tuple[int, int]] = concurrent.futures.Future()
    each = held_of_each_kind()
    received = asyncio.run(hold_all(stack.ar.port, each, meanwhile))
    assert meanwhile.result() == (200, 200)
    silent, slow = received[0::2], received[1::2]
    assert set(silent) == {b""}  # closed without a word: they asked nothing
    assert all(answer.startswith(b"HTTP/1.1 408") for answer in slow)
    closed = sample(stack.ar.url, "ardit_ar_connections_closed_total", reason="head_timeout") - closed_before
    assert closed >= 2 * each
    print(f"{each} silent and {each} slow connections: all closed by the head deadline; healthz and an image 200")


UNREAD_BODIES = 500
UNREAD_BODY_HEAD = b"POST /v1/images/generations HTTP/1.1\r\nhost: ardit\r\ncontent-length: 1000000\r\n\r\n"


async def trickle_unread_bodies(port: int, meanwhile: concurrent.futures.Future[tuple[int, int]]) -> list[bytes]:
    connections = [asyncio.ensure_future(held(port, True, UNREAD_BODY_HEAD)) for _ in range(UNREAD_BODIES)]
    await asyncio.sleep(TRICKLE_SECONDS)
    meanwhile.set_result(await asyncio.to_thread(real_client, port))
    return list(await asyncio.wait_for(asyncio.gather(*connections), HANG_GUARD))


def test_bodies_sent_a_byte_at_a_time_after_their_answer_are_closed_while_a_real_client_is_served(stack):
    closed_before = sample(stack.ar.url, "ardit_ar_connections_closed_total", reason="body_timeout")
    meanwhile: concurrent.futures.Future[tuple[int, int]] = concurrent.futures.Future()
    received = asyncio.run(trickle_unread_bodies(stack.ar.port, meanwhile))
    assert meanwhile.result() == (200, 200)
    assert all(answer.startswith(b"HTTP/1.1 401") for answer in received)  # answered at once, without the body
    closed = sample(stack.ar.url, "ardit_ar_connections_closed_total", reason="body_timeout") - closed_before
    assert closed == UNREAD_BODIES


def head_of(size: int) -> bytes:
    start, end = b"GET /healthz HTTP/1.1\r\nhost: ardit\r\nx-pad: ", b"\r\n\r\n"
    return start + b"p" * (size - len(start) - len(end)) + end


@pytest.mark.parametrize("service", ["ar", "dit"])
def test_a_head_one_byte_over_the_cap_is_431_and_one_at_the_cap_is_served(stack, service):
    port = stack.ar.port if service == "ar" else stack.dit.port
    statuses = []
    for size in (HEAD_BYTES, HEAD_BYTES + 1):
        with socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD) as client:
            client.sendall(head_of(size))
            statuses.append(int(client.recv(65536).split()[1]))
    assert statuses == [200, 431]
