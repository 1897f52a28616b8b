"""A stand-in DiT on a loopback port, for tests of one AR piece that talks to a DiT over HTTP.

``handler`` answers every request, as an aiohttp.web handler does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web
from aiohttp.test_utils import TestServer

from shared.capabilities import DitCapabilities
from tests.support.capabilities import DIT

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class RunningDit:
    url: str  # its base URL
    server: TestServer

    async def stop(self) -> None:
        """Stop listening: a connection to ``url`` is refused from now on."""
        await self.server.close()


@asynccontextmanager
async def fake_dit(handler: Handler) -> AsyncIterator[RunningDit]:
    app = web.Application()
    app.router.add_route("*", "/{path:.*}", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield RunningDit(str(server.make_url("")).rstrip("/"), server)
    finally:
        await server.close()


def ready(capabilities: DitCapabilities = DIT) -> web.Response:
    """The ``/readyz`` answer of a ready DiT announcing ``capabilities``."""
    return web.json_response(
        {"status": "ready", "reason": "ready", "capabilities": capabilities.model_dump(mode="json")}
    )
