"""Running a service's app under uvicorn until it stops: 0 when asked to, ``EXIT_CODE`` when fatal.

``server`` is the one uvicorn configuration every service runs with (the test suite's servers too):
uvicorn's httptools HTTP protocol, reporting its connections' write pauses to the app's ``SlowReaders``
and their request heads to its ``ConnectionGuard`` when it has them (through asyncio's protocol callbacks,
on the protocol class uvicorn's ``Config`` loads); and a SIGTERM drains the app (``services.drain``)
before the server stops, then exits 0.
"""

from __future__ import annotations

import contextlib
import signal
import socket
from collections.abc import Sequence
from types import FrameType

import uvicorn
from fastapi import FastAPI

from services.connection_guard import ConnectionGuard
from services.drain import Drain
from services.fatal import EXIT_CODE, Fatal
from services.slow_readers import SlowReaders

# What uvicorn waits for connections once the server stops (SIGINT; or once drained, when only
# idle keep-alive connections and last bytes remain).
GRACEFUL_SHUTDOWN_SECONDS = 10


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that the first SIGTERM drains the app instead of stopping at once."""

    def __init__(self, config: uvicorn.Config, drain: Drain | None) -> None:
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self.drain is not None and not self.drain.started:
            # Not recorded as a captured signal: uvicorn would raise it again once stopped, and the
            # process would die of it (-15) rather than exit 0 as a process asked to stop should.
            self.drain.begin()
            return
        if sig == signal.SIGTERM:
            self.should_exit = True  # a second SIGTERM: stop now
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain is not None and self.drain.over():
            self.should_exit = True
        return await super().on_tick(counter)


def server(app: FastAPI, host: str, port: int) -> DrainingServer:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http="httptools",
        ws="none",  # no service speaks WebSocket: an upgrade request is served as a plain one
        log_config=None,
        server_header=False,  # no "server: uvicorn": what runs the services is nobody's business
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
    )
    readers: SlowReaders | None = getattr(app.state, "slow_readers", None)
    connections: ConnectionGuard | None = getattr(app.state, "connections", None)
    if readers is not None or connections is not None:
        config.load()  # uvicorn's server does not load it again
    if readers is not None:
        config.http_protocol_class = readers.protocol(config.http_protocol_class)
    if connections is not None:
        config.http_protocol_class = connections.protocol(config.http_protocol_class)
    return DrainingServer(config, getattr(app.state, "drain", None))


def serve(app: FastAPI, host: str, ports: Sequence[int]) -> int:
    """Serve ``app`` (made by ``services.app.create_app``, which puts its ``Fatal`` and ``Drain`` on
    ``app.state``) on each of ``ports`` until it stops; the exit code says why."""
    fatal: Fatal = app.state.fatal
    running = server(app, host, ports[0])
    fatal.on_trigger(lambda: setattr(running, "should_exit", True))
    sockets = [_bound(host, port) for port in ports]
    # uvicorn re-raises the SIGINT it captured once it has shut down gracefully (uvicorn.run()
    # swallows it the same way): being asked to stop is not an error and needs no traceback.
    with contextlib.suppress(KeyboardInterrupt):
        running.run(sockets=sockets)
    return EXIT_CODE if fatal.reason is not None else 0


def _bound(host: str, port: int) -> socket.socket:
    """A listening socket (``create_server`` sets address reuse, as uvicorn does for its own)."""
    return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
