"""Draining: how a service asked to stop (SIGTERM: a rollout, a scale-down) loses no admitted work.

From the signal on, ``/readyz`` answers 503 (gateways and the AR's DiT pool stop sending), a new
request is refused at once with a 503 and ``Retry-After`` (a gateway retries it on another replica;
``admitted_while_draining`` names what must still come in: a DiT's handoff that holds a reservation),
and what was admitted runs on. The server stops as soon as nothing is in flight and nothing is held
(``holding``: a DiT's reserved places), or when ``grace_seconds`` have passed. Work still running at
that deadline is ended by ``bounded``: a request answers 503, a stream ends with an ``error`` event,
instead of being cut. ``services.serve`` turns the signal into ``begin`` and asks ``over`` each tick.

SIGINT (Ctrl-C, the launcher) keeps uvicorn's short graceful stop: an operator at a terminal wants it
now. The grace period is a setting of each service; Compose's ``stop_grace_period`` and Kubernetes'
``terminationGracePeriodSeconds`` (minus its ``preStop`` sleep) must be longer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from services.errors import ApiError, ErrorObserver

log = logging.getLogger("ardit.drain")

# What a refused client (or gateway) is told to wait: another replica is the real answer.
RETRY_AFTER_SECONDS = 1
# After the deadline, how long ended requests get to send their last bytes before the server stops.
LAST_WORDS_SECONDS = 2.0


def shutting_down() -> ApiError:
    return ApiError(
        503,
        "this replica is shutting down; retry the request (another replica will take it)",
        code="shutting_down",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


class Drain:
    def __init__(self, grace_seconds: float, *, holding: Callable[[], bool] = lambda: False) -> None:
        self.grace_seconds = grace_seconds
        self._holding = holding
        self._started_at: float | None = None  # time.monotonic(), the clock of the event loop
        self._deadline_set = False
        self._in_flight = 0
        self._bounds: set[asyncio.Timeout] = set()

    @property
    def started(self) -> bool:
        return self._started_at is not None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def begin(self) -> None:
        """Called from the signal handler: it only records the time (the loop picks it up in ``over``)."""
        if self._started_at is None:
            self._started_at = time.monotonic()

    def over(self) -> bool:
        """Whether the server may stop now; called on the event loop every tick once draining."""
        if self._started_at is None:
            return False
        if not self._deadline_set:
            self._deadline_set = True
            log.info(
                "draining: %d request(s) in flight, finishing within %g s; new ones are refused",
                self._in_flight,
                self.grace_seconds,
            )
            for bound in self._bounds:
                bound.reschedule(self._deadline())
        if self._in_flight == 0 and not self._holding():
            log.info("drained after %.1f s", time.monotonic() - self._started_at)
            return True
        if time.monotonic() > self._started_at + self.grace_seconds + LAST_WORDS_SECONDS:
            log.warning("drain period over with %d request(s) in flight; stopping", self._in_flight)
            return True
        return False

    def _deadline(self) -> float:
        assert self._started_at is not None
        return self._started_at + self.grace_seconds

    @contextlib.asynccontextmanager
    async def bounded(self) -> AsyncIterator[None]:
        """The work inside ends with ``shutting_down()`` if the drain's deadline passes first."""
        bound = asyncio.timeout(self._deadline() if self._deadline_set else None)
        self._bounds.add(bound)
        try:
            async with bound:
                yield
        except TimeoutError:
            if not bound.expired():
                raise  # a timeout of the work's own
            raise shutting_down() from None
        finally:
            self._bounds.discard(bound)

    def gate(
        self,
        app: ASGIApp,
        *,
        always_open: Iterable[str],
        admitted_while_draining: Callable[[Scope], bool],
        on_refusal: ErrorObserver,
    ) -> ASGIApp:
        return _DrainGate(app, self, frozenset(always_open), admitted_while_draining, on_refusal)

    def request_started(self) -> None:
        self._in_flight += 1

    def request_ended(self) -> None:
        self._in_flight -= 1


class _DrainGate:
    """Counts the requests in flight (probes and metrics aside) and refuses new ones while draining."""

    def __init__(
        self,
        app: ASGIApp,
        drain: Drain,
        always_open: frozenset[str],
        admitted_while_draining: Callable[[Scope], bool],
        on_refusal: ErrorObserver,
    ) -> None:
        self.app = app
        self._drain = drain
        self._open = always_open
        self._admitted = admitted_while_draining
        self._on_refusal = on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open:
            await self.app(scope, receive, send)
            return
        if self._drain.started and not self._admitted(scope):
            refused = shutting_down()
            self._on_refusal(refused)
            await refused.response()(scope, receive, send)
            return
        self._drain.request_started()
        try:
            await self.app(scope, receive, send)
        finally:
            self._drain.request_ended()
