"""Bounded admission for the public API: a fixed number of requests run, a bounded number wait,
and the rest are refused at once with 429 + ``Retry-After`` instead of queueing without bound."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from ar_service.metrics import ArMetrics
from services.errors import Overloaded


class RequestAdmission:
    def __init__(self, max_running: int, max_queued: int, metrics: ArMetrics, retry_after_seconds: int = 1) -> None:
        self._running = asyncio.Semaphore(max_running)
        self._max_waiting = max_queued
        self._waiting = 0
        self._metrics = metrics
        self._retry_after = retry_after_seconds
        self.in_flight = 0

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self._running.locked() and self._waiting >= self._max_waiting:
            raise Overloaded(
                "too many image requests in flight; retry shortly",
                code="rate_limit_exceeded",
                retry_after=self._retry_after,
            )
        self._waiting += 1
        self._metrics.requests_queued.set(self._waiting)
        queued_at = time.monotonic()
        try:
            await self._running.acquire()
        finally:
            self._waiting -= 1
            self._metrics.requests_queued.set(self._waiting)
        self._metrics.queue_wait_seconds.observe(time.monotonic() - queued_at)
        self.in_flight += 1
        self._metrics.requests_in_flight.set(self.in_flight)
        try:
            yield
        finally:
            self.in_flight -= 1
            self._metrics.requests_in_flight.set(self.in_flight)
            self._running.release()
