"""Bounded concurrency: refuse at once (429 + Retry-After) rather than queue without bound.

Two resources. A *handoff slot* is held while a handoff's body is being received (it bounds row
buffers in memory). A *run ticket* is taken when a handoff completes and held until its pipeline
run has finished; there are ``max_pipeline_runs + pipeline_queue_size`` of them, of which at most
``max_pipeline_runs`` execute at once (``run_slots``). A new handoff is refused up front when
either is exhausted, so senders do not stream rows that could not be rendered.

Everything here runs on the event loop thread, so plain counters are enough.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from services.errors import Overloaded


class RunTicket:
    def __init__(self, give_back: Callable[[], None]) -> None:
        self._give_back = give_back
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._give_back()


class AdmissionControl:
    def __init__(self, max_handoffs: int, max_runs: int, queue_size: int, retry_after_seconds: int) -> None:
        self._max_handoffs = max_handoffs
        self._max_tickets = max_runs + queue_size
        self._retry_after = retry_after_seconds
        self._receiving = 0
        self._tickets = 0
        self.run_slots = asyncio.Semaphore(max_runs)

    @contextmanager
    def handoff_slot(self) -> Iterator[None]:
        if self._receiving >= self._max_handoffs:
            raise self._busy(f"{self._max_handoffs} handoffs are already being received", "too_many_handoffs")
        self._check_tickets()
        self._receiving += 1
        try:
            yield
        finally:
            self._receiving -= 1

    def run_ticket(self) -> RunTicket:
        self._check_tickets()
        self._tickets += 1
        return RunTicket(self._return_ticket)

    def _return_ticket(self) -> None:
        self._tickets -= 1

    def _check_tickets(self) -> None:
        if self._tickets >= self._max_tickets:
            raise self._busy(f"the pipeline queue is full ({self._max_tickets} runs admitted)", "pipeline_queue_full")

    def _busy(self, message: str, code: str) -> Overloaded:
        return Overloaded(message, code=code, retry_after=self._retry_after)
