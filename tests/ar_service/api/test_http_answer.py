"""ar_service/api/http_answer.py: an event stream that has nothing to say sends keep-alive comments, every
interval, until its next event; the AR passes ``ARDIT_AR_SSE_KEEPALIVE_SECONDS`` (10 s by default) as the
interval, which a test would have to sit through: here it is 0.05 s, and the stream's silence lasts until the
client has read three comments, however fast or slow the machine."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator

from fastapi import FastAPI

from ar_service.api.http_answer import http_answer
from ar_service.api.serving import ImageEvent, StreamError
from services.errors import ApiError
from tests.support.live_server import LiveServer

INTERVAL = 0.05


def test_a_silent_stream_sends_keep_alive_comments_until_its_next_event():
    heard = threading.Event()  # set by the client once it has read three comments
    app = FastAPI()

    async def silent_then_done() -> AsyncIterator[ImageEvent]:  # the render: silent until the client heard enough
        while not heard.is_set():
            await asyncio.sleep(INTERVAL / 5)
        yield StreamError(ApiError(500, "over", code="internal_error"))

    @app.get("/events")
    async def events():
        return http_answer(silent_then_done(), INTERVAL)

    server = LiveServer(app).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:  # a hang guard
            sock.sendall(b"GET /events HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            received = b""
            while received.count(b": ping") < 3:
                received += sock.recv(4096)
            heard.set()
            while chunk := sock.recv(4096):
                received += chunk
    finally:
        server.stop()
    head, _, body = received.partition(b"\r\n\r\n")
    assert b"x-accel-buffering: no" in head.lower()
    assert body.index(b"event: error") > body.rindex(b": ping") > 0
