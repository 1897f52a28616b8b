"""A real uvicorn server on a loopback port, in a thread of the test process, whose event loop
tests can run coroutines on (the AR engine belongs to the loop it serves from)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI

from services.serve import server

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
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def wait_ready(self, timeout: float = 600.0) -> LiveServer:
        deadline = time.monotonic() + timeout
        while True:
            response = httpx.get(f"{self.url}/readyz")
            if response.status_code == 200:
                return self
            if time.monotonic() > deadline or "failed" in response.json().get("reason", ""):
                raise RuntimeError(f"not ready: {response.json()}")
            time.sleep(0.2)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 600.0) -> T:
        """Run ``coro`` on the server's event loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()
