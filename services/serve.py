"""Running a service's app under uvicorn until it stops: 0 when asked to, ``EXIT_CODE`` when fatal.

``server`` is the one uvicorn configuration every service runs with (the test suite's servers too):
its HTTP protocol reports stalled readers to the app's ``SlowReaders``, when the app has one.
"""

from __future__ import annotations

import contextlib

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from services.fatal import EXIT_CODE, Fatal
from services.slow_readers import SlowReaders

GRACEFUL_SHUTDOWN_SECONDS = 10


def server(app: FastAPI, host: str, port: int) -> uvicorn.Server:
    guard: SlowReaders | None = getattr(app.state, "slow_readers", None)
    http = guard.protocol(AutoHTTPProtocol) if guard is not None else AutoHTTPProtocol
    config = uvicorn.Config(
        app, host=host, port=port, http=http, log_config=None, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS
    )
    return uvicorn.Server(config)


def serve(app: FastAPI, host: str, port: int) -> int:
    """Serve ``app`` (made by ``services.app.create_app``, which puts its ``Fatal`` on ``app.state``) until it
    stops; the exit code says why."""
    fatal: Fatal = app.state.fatal
    running = server(app, host, port)
    fatal.on_trigger(lambda: setattr(running, "should_exit", True))
    # uvicorn re-raises the SIGINT it captured once it has shut down gracefully (uvicorn.run()
    # swallows it the same way): being asked to stop is not an error and needs no traceback.
    with contextlib.suppress(KeyboardInterrupt):
        running.run()
    return EXIT_CODE if fatal.reason is not None else 0
