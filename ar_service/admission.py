"""Admission of image requests against the capacity of the whole AR+DiT pair, decided at arrival.

A request is admitted once, here, before any engine work. At most ``capacity`` requests are in
flight, where ``capacity`` is what the DiTs announced they hold (``DitCapacity.max_outstanding``):
the AR never prefills a request the DiTs have no room for. A request beyond that waits, first come
first served, if it can start within ``max_wait`` seconds by the pair's measured pace; otherwise it
is refused with 429 at once, with ``Retry-After`` the time until it could be admitted. A request
admitted to the queue is served: it leaves the queue only to start, or when its client leaves.

The pace is the mean time between completions while requests wait in line (over the last
``_WINDOW`` of them): the rate at which a line moves, measured while there is one. Whatever the
announced capacity, a DiT that renders one run at a time completes one request per render. The
intervals of a pair that is busy with no line (a lone request: its whole service time; the last
requests of a burst finishing close together) say little about that rate and are used only until
the first line is measured. Until the first completion the pace is unknown: one round of
``capacity`` requests may wait, the rest are refused, at once.

A request enters at arrival, before its body is parsed (``AdmissionDoor``, in front of the image
routes): ``enter`` gives it a slot now, a place in line, or the 429 — a few microseconds, so a burst
of hundreds is answered within one pass over it. Its place then travels with the request to serving,
which validates it and waits for its turn (``AdmissionPlace.turn``); a place given up before its turn
(a request refused as invalid, a client gone) lets the line move on.

Everything runs on the event loop thread, so plain counters and futures are enough.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque

from ar_service.metrics import ArMetrics
from services.errors import Overloaded

# Completions the pace is the mean of.
_WINDOW = 32
# Bounds of Retry-After, in seconds.
_RETRY_AFTER = (1, 60)


class AdmissionTicket:
    """One admitted request's slot; ``release`` is idempotent. ``served``: the request's work completed
    (only those measure the pace; a failure or a client that left says nothing about it)."""

    def __init__(self, admission: RequestAdmission) -> None:
        self._admission = admission
        self._held = True

    def release(self, served: bool) -> None:
        if self._held:
            self._held = False
            self._admission.finished(served)


class AdmissionPlace:
    """A request's place, taken at arrival: a slot already, or a turn in line. ``turn`` gives the slot
    as a ticket (waiting for it if needed); ``leave`` gives the place up, once, if the ticket was not taken."""

    def __init__(self, admission: RequestAdmission, turn: asyncio.Future[None]) -> None:
        self._admission = admission
        self._turn = turn
        self._entered_at = time.monotonic()
        self._settled = False

    @property
    def started(self) -> bool:
        """The slot is this request's: ``turn`` returns at once."""
        return self._turn.done() and not self._turn.cancelled()

    async def turn(self) -> AdmissionTicket:
        try:
            await self._turn
        except BaseException:
            self.leave()  # the client left while in line
            raise
        self._settled = True
        self._admission.observe_wait(time.monotonic() - self._entered_at)
        return AdmissionTicket(self._admission)

    def leave(self) -> None:
        if not self._settled:
            self._settled = True
            self._admission.left(self._turn)


class RequestAdmission:
    def __init__(self, max_queued: int, max_wait: float, metrics: ArMetrics) -> None:
        self._max_queued = max_queued
        self._max_wait = max_wait
        self._metrics = metrics
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._running = 0
        self._capacity = 1
        # Seconds between completions while busy, and those that ended with requests waiting in line.
        self._busy_intervals: deque[float] = deque(maxlen=_WINDOW)
        self._line_intervals: deque[float] = deque(maxlen=_WINDOW)
        self._busy_since: float | None = None
        self._last_completion = float("-inf")

    @property
    def in_flight(self) -> int:
        return self._running

    def enter(self, capacity: int) -> AdmissionPlace:
        """A slot among ``capacity`` now, or a place in line; ``Overloaded`` (429) at once when the line
        is full or the wait would be longer than ``max_wait``."""
        self._capacity = capacity
        if self._waiting and self._running < capacity:
            self._start_waiting()  # the DiTs announced more room since the last request
        if self._running < capacity and not self._waiting:
            self._start()
            started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            started.set_result(None)
            return AdmissionPlace(self, started)
        # A refusal is decided before anything is made for it: in a burst, most arrivals end here.
        ahead = len(self._waiting)
        if ahead >= self._max_queued:
            raise self._refuse(f"the queue is full ({self._max_queued} requests wait)", ahead)
        wait = self._estimated_wait(ahead)
        if wait is None and ahead >= capacity:
            raise self._refuse("the pace of this service is not measured yet; one round may wait", ahead)
        if wait is not None and wait > self._max_wait:
            raise self._refuse(f"the wait would be about {wait:.0f} s, over {self._max_wait:g} s", ahead)
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        self._metrics.requests_queued.set(len(self._waiting))
        return AdmissionPlace(self, turn)

    @property
    def pace(self) -> float | None:
        """Seconds between completions, as the line moves; None until a request has finished."""
        window = self._line_intervals or self._busy_intervals
        return sum(window) / len(window) if window else None

    def finished(self, served: bool) -> None:
        if served:
            now = time.monotonic()
            since = max(self._last_completion, self._busy_since if self._busy_since is not None else now)
            self._busy_intervals.append(now - since)
            if self._waiting:
                self._line_intervals.append(now - since)
            self._metrics.admission_pace_seconds.set(self.pace or 0.0)
            self._last_completion = now
        self._end_one()

    def _end_one(self) -> None:
        self._running -= 1
        if self._running == 0:
            self._busy_since = None
        self._start_waiting()

    def left(self, turn: asyncio.Future[None]) -> None:
        """A place given up before its ticket was taken: a slot already handed to it goes to the next in line."""
        if turn.done() and not turn.cancelled():
            self._end_one()
            return
        turn.cancel()
        if turn in self._waiting:
            self._waiting.remove(turn)
        self._metrics.requests_queued.set(len(self._waiting))

    def observe_wait(self, seconds: float) -> None:
        self._metrics.queue_wait_seconds.observe(seconds)

    def _start(self) -> None:
        self._running += 1
        if self._busy_since is None:
            self._busy_since = time.monotonic()
        self._metrics.requests_in_flight.set(self._running)

    def _start_waiting(self) -> None:
        while self._waiting and self._running < self._capacity:
            turn = self._waiting.popleft()
            if not turn.done():
                self._start()
                turn.set_result(None)
        self._metrics.requests_in_flight.set(self._running)
        self._metrics.requests_queued.set(len(self._waiting))

    def _estimated_wait(self, ahead: int) -> float | None:
        """Seconds until a request with ``ahead`` requests in line before it starts: one completion each,
        and one more for its own slot, at the measured pace."""
        pace = self.pace
        return None if pace is None else (ahead + 1) * pace

    def _refuse(self, why: str, ahead: int) -> Overloaded:
        wait = self._estimated_wait(ahead)
        until_room = _RETRY_AFTER[0] if wait is None else wait - self._max_wait
        retry_after = min(_RETRY_AFTER[1], max(_RETRY_AFTER[0], until_room))
        return Overloaded(
            f"too many image requests: {why}; retry in {math.ceil(retry_after)} s",
            code="rate_limit_exceeded",
            retry_after=math.ceil(retry_after),
        )
