"""A real uvicorn server on a loopback port, in a thread of the test process, whose event loop
tests can run coroutines on (the AR engine belongs to the loop it serves from)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI

from services.serve import server
from tests.support.waiting import holds_within

T = TypeVar("T")


class LiveServer:
    def __init__(
        self,
        app: FastAPI,
        port: int = 0,
        send_buffer_bytes: int | None = None,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop,
    ) -> None:
        """``port``: 0 for a free one; ``send_buffer_bytes``: the kernel's send buffer of every connection
        (Linux gives accepted sockets their listener's), else the kernel's own, which grows to megabytes;
        ``loop_factory``: uvloop's to run as ``python -m <service>`` does (uvicorn's ``loop="auto"``)."""
        self.app = app
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if send_buffer_bytes is not None:
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
        self._socket.bind(("127.0.0.1", port))
        self.port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = server(app, "127.0.0.1", self.port)  # as `python -m <service>` runs it
        self.loop = loop_factory()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._server.serve(sockets=[self._socket]))

    def start(self, timeout: float = 60.0) -> LiveServer:
        self._thread.start()
        holds_within(lambda: self._server.started or not self._thread.is_alive(), timeout)
        if not self._server.started:
            raise RuntimeError("uvicorn did not start")
        return self

    def wait_ready(self, timeout: float = 600.0) -> LiveServer:
        answers: list[httpx.Response] = []

        def ready_or_failed() -> bool:
            answers[:] = [httpx.get(f"{self.url}/readyz")]
            return answers[0].status_code == 200 or "failed" in answers[0].json().get("reason", "")

        holds_within(ready_or_failed, timeout, every=0.2)  # a look runs the service's readiness check
        if answers[0].status_code != 200:
            raise RuntimeError(f"not ready: {answers[0].json()}")
        return self

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 600.0) -> T:
        """Run ``coro`` on the server's event loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()
