"""Admission of image requests against the capacity of the whole AR+DiT pair, with a real queue.

A request is admitted once, here, before any engine work. At most ``capacity`` requests are in
flight, where ``capacity`` is what the DiT announced it holds (``DitCapacity.max_outstanding``):
the AR never prefills a request the DiT has no room for, and a busy DiT is never "unavailable".
Requests beyond that WAIT, first come first served, in a bounded queue, each at most
``max_wait`` seconds. A request is refused with 429 only when the queue is full or its wait,
estimated from the observed service rate, would exceed ``max_wait`` — at once, before any work;
``Retry-After`` is the estimated time until there is room.

Everything runs on the event loop thread, so plain counters and futures are enough.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque

from ar_service.metrics import ArMetrics
from services.errors import Overloaded

# Weight of the newest service time in the running average (about the last ten requests).
_SMOOTHING = 0.1
# Bounds of Retry-After, in seconds.
_RETRY_AFTER = (1, 60)


class AdmissionTicket:
    """One admitted request's slot; ``release`` is idempotent."""

    def __init__(self, admission: RequestAdmission) -> None:
        self._admission = admission
        self._started = time.monotonic()
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission.finished(time.monotonic() - self._started)


class RequestAdmission:
    def __init__(self, max_queued: int, max_wait: float, metrics: ArMetrics) -> None:
        self._max_queued = max_queued
        self._max_wait = max_wait
        self._metrics = metrics
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._running = 0
        self._capacity = 1
        self._service_seconds: float | None = None  # running average; None until one finished

    @property
    def in_flight(self) -> int:
        return self._running

    async def admit(self, capacity: int) -> AdmissionTicket:
        """Wait (FIFO) for a slot among ``capacity``; ``Overloaded`` (429) when there is no room to wait."""
        self._capacity = capacity
        if self._running < capacity and not self._waiting:
            self._running += 1
            return self._ticket(queued_seconds=0.0)
        ahead = len(self._waiting) + 1
        if ahead > self._max_queued:
            raise self._refuse(f"the queue is full ({self._max_queued} requests wait)", ahead)
        estimate = self._estimated_wait(ahead)
        if estimate is not None and estimate > self._max_wait:
            raise self._refuse(f"the wait would be about {estimate:.0f} s, over {self._max_wait:g} s", ahead)
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = loop.create_future()
        self._waiting.append(turn)
        self._metrics.requests_queued.set(len(self._waiting))
        queued_at = time.monotonic()
        expiry = loop.call_later(self._max_wait, self._expire, turn)
        try:
            await turn
        except BaseException:
            # Given up (cancelled by a client that left, or expired): a slot handed over in the
            # meantime goes to the next in line.
            if turn.done() and not turn.cancelled() and turn.exception() is None:
                self._give_back()
            raise
        finally:
            expiry.cancel()
            if turn in self._waiting:
                self._waiting.remove(turn)
            self._metrics.requests_queued.set(len(self._waiting))
        return self._ticket(queued_seconds=time.monotonic() - queued_at)

    def finished(self, service_seconds: float) -> None:
        average = self._service_seconds
        self._service_seconds = (
            service_seconds if average is None else average + _SMOOTHING * (service_seconds - average)
        )
        self._give_back()

    def _ticket(self, queued_seconds: float) -> AdmissionTicket:
        self._metrics.requests_in_flight.set(self._running)
        self._metrics.queue_wait_seconds.observe(queued_seconds)
        return AdmissionTicket(self)

    def _give_back(self) -> None:
        self._running -= 1
        self._metrics.requests_in_flight.set(self._running)
        while self._waiting and self._running < self._capacity:
            turn = self._waiting.popleft()
            if not turn.done():
                self._running += 1
                turn.set_result(None)

    def _expire(self, turn: asyncio.Future[None]) -> None:
        if not turn.done():
            if turn in self._waiting:
                self._waiting.remove(turn)
            turn.set_exception(self._refuse(f"no room within {self._max_wait:g} s", len(self._waiting) + 1))

    def _estimated_wait(self, ahead: int) -> float | None:
        """Seconds until ``ahead`` waiting requests have started, at the observed service rate."""
        if self._service_seconds is None:
            return None
        per_request = self._service_seconds / max(1, self._capacity)
        return ahead * per_request

    def _refuse(self, why: str, ahead: int) -> Overloaded:
        estimate = self._estimated_wait(ahead)
        retry_after = _RETRY_AFTER[0] if estimate is None else min(_RETRY_AFTER[1], max(_RETRY_AFTER[0], estimate))
        return Overloaded(
            f"too many image requests: {why}; retry shortly",
            code="rate_limit_exceeded",
            retry_after=math.ceil(retry_after),
        )
