"""Clients that stop reading, at the defaults: they hold no capacity, and are cut off after the send timeout.

As the issue's tester did: as many streaming requests as the pair has places (``stream``, three
previews, ten images: answers of about 7 MB, more than the socket buffers in front of them hold), each
from a socket with a small receive buffer that is never read. Their work ends and gives its places
back while the answers wait; normal requests then start at once; ``send_timeout_seconds`` after each
stalled, the connections are closed and counted, and what they held is freed.
"""

from __future__ import annotations

import json
import socket

import httpx
import psutil
import pytest

from tests.conftest import API_KEY, OTHER_API_KEY, Stack
from tests.e2e.metrics_text import sample
from tests.e2e.test_lifecycle import HEADERS, post, settled
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

STALLED_BODY = {"prompt": "a lantern", "stream": True, "partial_images": 3, "n": 10, "num_inference_steps": 3}


def stalled_stream(stack: Stack, key: str) -> socket.socket:
    """A streaming request from a socket whose small receive buffer is never read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", stack.ar.port))
    body = json.dumps(STALLED_BODY).encode()
    head = (
        "POST /v1/images/generations HTTP/1.1\r\nHost: ar\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def closed(sock: socket.socket) -> bool:
    """Reading what is left ends (EOF, or the reset of an aborted connection) instead of waiting."""
    sock.settimeout(10)
    try:
        while sock.recv(1 << 20):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def test_stalled_readers_hold_no_capacity_and_are_cut_off_after_the_send_timeout(stack):
    ar = stack.ar.url
    _, capacity = stack.ar.call(stack.runtime.readiness.require())
    solo = [post(stack, prompt="a bell", num_inference_steps=2) for _ in range(2)][-1]
    assert solo.status_code == 200
    # One such answer read in full first: the DiT (in this process too) and the allocator reach the
    # memory this work takes, so what is measured after is what the stalled answers leave behind.
    warm = httpx.post(f"{stack.api_base}/images/generations", json=STALLED_BODY, headers=HEADERS, timeout=300)
    assert warm.status_code == 200 and len(warm.content) > 4 << 20
    closed_before = sample(ar, "ardit_ar_slow_readers_closed_total", reason="send_timeout")
    rss_before = psutil.Process().memory_info().rss

    # From both API keys in turn: one key's share of the line (max_queue_wait_per_key_seconds) holds fewer of
    # these heavy answers than the pair has places.
    stalled = [stalled_stream(stack, (API_KEY, OTHER_API_KEY)[i % 2]) for i in range(capacity)]
    try:
        # The DiT renders them one after another (about 15 s each here): the first may be cut off before the
        # last is rendered. Once all their work is over, each is stalled or was cut off, none finished.
        wait_for(lambda: sample(ar, "ardit_ar_requests_in_flight") > 0, 30, "the stalled requests start", every=0.2)
        rendered_in = wait_for(
            lambda: not any(settled(stack, 0).values()), 600, "the stalled requests' work ends", every=0.2
        )

        def cut() -> float:
            return sample(ar, "ardit_ar_slow_readers_closed_total", reason="send_timeout") - closed_before

        assert sample(ar, "ardit_ar_slow_readers") + cut() == capacity
        assert sample(ar, "ardit_ar_slow_readers") >= 1 and sample(ar, "ardit_ar_slow_reader_bytes") > 0
        rss_stalled = psutil.Process().memory_info().rss
        # The stalled hold no slot and no place in line: the requests that come now take free slots.
        assert sample(ar, "ardit_ar_requests_in_flight") == sample(ar, "ardit_ar_requests_queued") == 0
        normal = [post(stack, prompt="a bell", num_inference_steps=2) for _ in range(3)]
        assert [r.status_code for r in normal] == [200] * 3
        wait_for(
            lambda: cut() == capacity, stack.settings.send_timeout_seconds + 30, "the stalled are cut off", every=0.2
        )
        for sock in stalled:
            assert closed(sock)
    finally:
        for sock in stalled:
            sock.close()
    assert sample(ar, "ardit_ar_slow_readers") == 0 and sample(ar, "ardit_ar_slow_reader_bytes") == 0
    rss_after = psutil.Process().memory_info().rss
    print(
        f"{capacity} stalled readers: solo {solo.elapsed.total_seconds():.2f} s, normal requests meanwhile "
        f"{[round(r.elapsed.total_seconds(), 2) for r in normal]} s (rendered in {rendered_in:.0f} s, then cut off); "
        f"RSS {rss_before / 2**20:.0f} MB -> {rss_stalled / 2**20:.0f} MB stalled -> {rss_after / 2**20:.0f} MB"
    )
    assert rss_after - rss_before < 100 * 2**20
