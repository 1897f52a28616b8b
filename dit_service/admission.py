"""Bounded concurrency: refuse at once (429 + Retry-After) rather than queue without bound.

A *place* is what one request holds at this DiT, from the moment it is taken to the end of its
pipeline run: while its rows arrive, while it waits for a run, while it runs. There are
``min(max_handoffs, max_runs + queue_size)`` of them (what the DiT announces as ``max_outstanding``),
and at most ``max_runs`` runs execute at once (``run_slots``).

A sender takes a place in one of two ways. It *reserves* one (``POST /v1/handoff/reservations``)
before it does any work of its own — so an AR learns that this DiT is full before it runs the prompt
through its engine, and can offer the request to another replica — and then names the reservation
when its handoff arrives; an unused reservation lapses after ``reservation_seconds``. Or its handoff
takes a free place when it arrives. Either way a handoff that has a place is never refused later for
lack of room: its rows are not received only to be thrown away.

Everything here runs on the event loop thread, so plain counters are enough.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable

from services.errors import Overloaded


class Place:
    """One request's place; ``release`` (at the end of its run, or when its handoff fails) is idempotent."""

    def __init__(self, give_back: Callable[[], None]) -> None:
        self._give_back = give_back
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._give_back()


class AdmissionControl:
    def __init__(
        self, max_handoffs: int, max_runs: int, queue_size: int, retry_after_seconds: int, reservation_seconds: float
    ) -> None:
        self.places = min(max_handoffs, max_runs + queue_size)
        self.run_slots = asyncio.Semaphore(max_runs)
        self._retry_after = retry_after_seconds
        self.reservation_seconds = reservation_seconds
        self._taken = 0
        self._reservations: dict[str, asyncio.TimerHandle] = {}

    @property
    def taken(self) -> int:
        """Places held: reserved, receiving, waiting for a run or running."""
        return self._taken

    def reserve(self) -> str:
        """A place held for the handoff that names the returned id, for ``reservation_seconds``."""
        self._take()
        reservation = secrets.token_urlsafe(12)
        self._reservations[reservation] = asyncio.get_running_loop().call_later(
            self.reservation_seconds, self._lapse, reservation
        )
        return reservation

    def cancel(self, reservation: str) -> None:
        """The sender will not send the handoff after all: its place is free again (unknown ids: nothing)."""
        self._lapse(reservation)

    def place(self, reservation: str | None) -> Place:
        """A handoff's place: the one ``reservation`` holds, else a free one now (429 if none is)."""
        timer = self._reservations.pop(reservation, None) if reservation is not None else None
        if timer is not None:
            timer.cancel()
        else:
            self._take()
        return Place(self._give_back)

    def _take(self) -> None:
        if self._taken >= self.places:
            raise Overloaded(
                f"every place is taken ({self.places}: handoffs being received, waiting for a run or running)",
                code="dit_full",
                retry_after=self._retry_after,
            )
        self._taken += 1

    def _give_back(self) -> None:
        self._taken -= 1

    def _lapse(self, reservation: str) -> None:
        timer = self._reservations.pop(reservation, None)
        if timer is not None:
            timer.cancel()
            self._give_back()
