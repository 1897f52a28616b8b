"""Running a service's app under uvicorn until it stops: 0 when asked to, ``EXIT_CODE`` when fatal."""

from __future__ import annotations

import contextlib

import uvicorn
from fastapi import FastAPI

from services.fatal import EXIT_CODE, Fatal


def serve(app: FastAPI, host: str, port: int, graceful_shutdown_seconds: int = 10) -> int:
    """Serve ``app`` (made by ``services.app.create_app``, which puts its ``Fatal`` on ``app.state``) until it
    stops; the exit code says why."""
    fatal: Fatal = app.state.fatal
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_config=None, timeout_graceful_shutdown=graceful_shutdown_seconds)
    )
    fatal.on_trigger(lambda: setattr(server, "should_exit", True))
    # uvicorn re-raises the SIGINT it captured once it has shut down gracefully (uvicorn.run()
    # swallows it the same way): being asked to stop is not an error and needs no traceback.
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return EXIT_CODE if fatal.reason is not None else 0
