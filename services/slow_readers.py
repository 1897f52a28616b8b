"""Clients that stop reading: their connections are closed after a send timeout, and the answers
waiting on them are bounded in number and in bytes.

A response goes out as the app sends it; a client that stops reading fills its socket, then the
server's write buffer, and from then on the app's next send waits. ardit never lets that hold a
request's capacity (the AR gives its admission slot back when the work is done, not when the answer
has been read), so what a stalled reader can still hold is memory: the bytes buffered for it. This is
watched where it happens, at the transport: uvicorn's HTTP protocol is told by asyncio when a
connection's write buffer passes its high-water mark (``pause_writing``) and when it drains again
(``resume_writing``). A paused connection whose client takes no byte for ``send_timeout`` seconds is
aborted (its buffer freed at once); so is one that pauses while ``max_responses`` others already
wait, or while ``max_bytes`` are already buffered for slow readers. A reader that is slow but still
reading is never cut, however large the answer and however long it stays paused.

``protocol(base)`` is the uvicorn HTTP protocol class with the guard installed; ``services.serve``
runs every service with it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, TypeVar

from services.metrics import Families

log = logging.getLogger("ardit.slow_readers")

P = TypeVar("P", bound=asyncio.Protocol)

CLOSE_REASONS = ("send_timeout", "too_many_waiting")


class SlowReaders:
    def __init__(self, families: Families, *, send_timeout: float, max_responses: int, max_bytes: int) -> None:
        self._send_timeout = send_timeout
        self._max_responses = max_responses
        self._max_bytes = max_bytes
        self._waiting: dict[asyncio.Transport, asyncio.TimerHandle] = {}
        self.closed = families.counter(
            "slow_readers_closed",
            "Connections closed because the client stopped reading its answer, by reason (send_timeout: "
            "nothing taken for the send timeout; too_many_waiting: over the bound on answers waiting).",
            ("reason",),
            start=CLOSE_REASONS,
        )
        self.readers = families.gauge(
            "slow_readers", "Answers waiting on a client that stopped reading (write paused)."
        )
        self.readers.set_function(lambda: len(self._waiting))
        self.reader_bytes = families.gauge("slow_reader_bytes", "Bytes buffered for clients that stopped reading.")
        self.reader_bytes.set_function(self.buffered_bytes)

    def buffered_bytes(self) -> int:
        return sum(transport.get_write_buffer_size() for transport in self._waiting)

    def paused(self, transport: asyncio.Transport) -> None:
        """The client stopped taking bytes: give it ``send_timeout``, or none if too many already wait."""
        if len(self._waiting) >= self._max_responses or self.buffered_bytes() > self._max_bytes:
            self._close(transport, "too_many_waiting")
            return
        self._watch(transport, transport.get_write_buffer_size())

    def resumed(self, transport: asyncio.Transport) -> None:
        timer = self._waiting.pop(transport, None)
        if timer is not None:
            timer.cancel()

    def _watch(self, transport: asyncio.Transport, buffered: int) -> None:
        loop = asyncio.get_running_loop()
        self._waiting[transport] = loop.call_later(self._send_timeout, self._check, transport, buffered)

    def _check(self, transport: asyncio.Transport, buffered_before: int) -> None:
        """``send_timeout`` after the last look: a client that took bytes since gets another timeout (a large
        answer drains slowly and stays above the low-water mark all along); one that took none is cut off."""
        buffered = transport.get_write_buffer_size()
        if buffered < buffered_before:
            self._watch(transport, buffered)
        else:
            self._close(transport, "send_timeout")

    def _close(self, transport: asyncio.Transport, reason: str) -> None:
        self.resumed(transport)
        if transport.is_closing():
            return
        peer = transport.get_extra_info("peername")
        log.warning("closing the connection of %s: it stopped reading its answer (%s)", peer, reason)
        self.closed.labels(reason).inc()
        transport.abort()

    def protocol(self, base: type[P]) -> type[P]:
        """``base`` (a uvicorn HTTP protocol class) reporting its connections' write pauses to this guard."""
        guard = self

        class Guarded(base):  # type: ignore[valid-type,misc]
            transport: Any

            def pause_writing(self) -> None:
                super().pause_writing()
                guard.paused(self.transport)

            def resume_writing(self) -> None:
                super().resume_writing()
                guard.resumed(self.transport)

            def connection_lost(self, exc: Exception | None) -> None:
                guard.resumed(self.transport)
                super().connection_lost(exc)

        return Guarded
