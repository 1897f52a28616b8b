"""A service that can no longer serve says so once, stops, and exits non-zero.

Staying up unready forever helps nobody: a process supervisor (the launcher, Docker's
``restart:``, Kubernetes) restarts a process that exits. ``Fatal.trigger`` records why, turns
readiness off (the service's probe reads ``reason``), and asks the HTTP server to shut down
gracefully; ``python -m <service>`` then exits with ``EXIT_CODE``. Tests that run a service in
their own process register their own ``on_trigger`` (stopping only that server).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("ardit.fatal")

# Distinct from Python's 1 (an unhandled exception at start-up) so operators can tell them apart.
EXIT_CODE = 3
# The settings name something that cannot serve (sysexits' EX_CONFIG): the message says what, in one line,
# and a restart would fail the same way, so the launcher does not try one.
EXIT_SETTINGS = 78


class Fatal:
    def __init__(self) -> None:
        self.reason: str | None = None
        self._handlers: list[Callable[[], None]] = []

    def on_trigger(self, handler: Callable[[], None]) -> None:
        self._handlers.append(handler)

    def trigger(self, reason: str) -> None:
        if self.reason is not None:
            return
        self.reason = reason
        log.critical("cannot serve any more, stopping: %s", reason)
        for handler in self._handlers:
            handler()
