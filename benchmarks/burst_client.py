"""A burst of requests sent all at once, timed as the server answers them (benchmarks/load.py's
over-capacity round, and tests/e2e/test_load.py's burst): stdlib only, so both can import it.

``python benchmarks/burst_client.py URL COUNT SIZE STEPS`` sends one burst from a process of its own
and prints each answer's status and seconds as JSON: what a test uses when its own process holds
other servers' threads (the test suite's in-process AR and DiT), which would share this client's
interpreter lock and stretch every latency it measures."""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import time


def request(seed: int, size: str, steps: int) -> bytes:
    """One image request as raw HTTP/1.1."""
    body = {"prompt": f"a red square number {seed % 8}", "size": size, "seed": seed, "num_inference_steps": steps}
    data = json.dumps(body).encode()
    head = (
        "POST /v1/images/generations HTTP/1.1\r\nHost: ar\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + data


async def burst_at_once(ar_url: str, requests: list[bytes]) -> list[tuple[int, float]]:
    """``requests`` (raw HTTP/1.1, written in advance) sent all at once, each on a connection opened and
    accepted in advance; each answer's status and seconds (request written → status line read).

    The client does next to nothing per request, so a latency is the server's: an httpx client's own
    few ms per request, one process opening hundreds of connections one after another, or this
    process's own garbage collections (one full collection of a heap holding torch stops it for about
    half a second) would add up over a burst and be measured instead."""
    host, port = ar_url.removeprefix("http://").split(":")

    async def one(connection: tuple[asyncio.StreamReader, asyncio.StreamWriter], raw: bytes) -> tuple[int, float]:
        reader, writer = connection
        started = time.monotonic()
        writer.write(raw)
        status = int((await reader.readline()).split()[1])
        seconds = time.monotonic() - started
        answer = await reader.read()
        writer.close()
        if status == 429:
            assert b"retry-after: " in answer.lower(), "a refusal says when to retry"
        return status, seconds

    connections = await asyncio.gather(*(asyncio.open_connection(host, int(port)) for _ in requests))
    await asyncio.sleep(0.5)  # accepted by the server: the burst is the requests, not the handshakes
    gc.disable()
    try:
        return await asyncio.gather(*(one(c, raw) for c, raw in zip(connections, requests, strict=True)))
    finally:
        gc.enable()


if __name__ == "__main__":
    url, count, size, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    answers = asyncio.run(burst_at_once(url, [request(seed, size, steps) for seed in range(count)]))
    print(json.dumps(answers))
