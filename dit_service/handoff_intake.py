"""One handoff body in, one assembled handoff out — with a stall timeout and honest memory accounting.

Chunks go straight into the shared ``HandoffReceiver`` (rows land by index in the buffer allocated
from ``open``). The ``open`` frame is checked against this DiT as soon as it arrives, before its memory is
allocated or another frame read (an edit this DiT cannot draw is refused before its pixels). Whatever ends
the handoff — a contract violation, an ``abort``, a stall, a dropped connection, or the consumer
being done with the rows — releases the row buffer and brings ``ardit_dit_handoff_buffer_bytes``
back down by exactly what this handoff added. With a ``RowBufferPool`` released buffers stay warm
for the next handoff (page faults on fresh memory cost more than the copy), bounded by the pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

from prometheus_client import Gauge
from starlette.requests import ClientDisconnect

from dit_service.metrics import CLIENT_DISCONNECTED, DitMetrics
from shared.errors import HandoffDeadlineExceeded, HandoffError, HandoffStalled
from shared.frame_codec import FrameLimits
from shared.frames import OpenFrame
from shared.handoff_assembler import AssembledHandoff, AssemblyCaps, HandoffReceiver
from shared.row_buffer_pool import RowBufferPool

# What the check of an ``open`` frame answers when it accepts it (the DiT's: the conditioning adapter it checked).
Accepted = TypeVar("Accepted")


@dataclass(frozen=True)
class Received(Generic[Accepted]):
    handoff: AssembledHandoff
    # The open frame's check's answer.
    accepted: Accepted


log = logging.getLogger("ardit.dit.intake")


class _BufferAccount:
    """This handoff's share of the buffer-bytes gauge."""

    def __init__(self, gauge: Gauge) -> None:
        self._gauge = gauge
        self._counted = 0

    def set(self, allocated: int) -> None:
        self._gauge.inc(allocated - self._counted)
        self._counted = allocated


@dataclass(frozen=True)
class HandoffIntake:
    caps: AssemblyCaps
    limits: FrameLimits
    stall_timeout: float
    deadline: float
    metrics: DitMetrics
    pool: RowBufferPool | None

    @asynccontextmanager
    async def receive(
        self, chunks: AsyncIterator[bytes], check_open: Callable[[OpenFrame], Accepted]
    ) -> AsyncIterator[Received[Accepted]]:
        """Yields the complete handoff with what ``check_open`` answered for its ``open`` frame; its rows are released
        when the block exits."""
        # The check's answer: the receiver asks it as soon as ``open`` has arrived, before anything is allocated or
        # another frame read; a handoff that finishes has had its ``open``.
        accepted: list[Accepted] = []
        receiver = HandoffReceiver(
            self.caps, self.limits, self.pool, check_open=lambda frame: accepted.append(check_open(frame))
        )
        account = _BufferAccount(self.metrics.handoff_buffer_bytes)
        try:
            handoff = await self._assemble(receiver, account, chunks)
            received = Received(handoff, accepted[0])
            try:
                yield received
            except HandoffError as exc:
                # The consumer refused the assembled rows (e.g. a prompt too long for the DiT).
                self._failed(exc.code, exc.message)
                raise
        finally:
            receiver.assembler.release()
            account.set(0)
            if self.pool is not None:
                self.metrics.handoff_buffer_idle_bytes.set(self.pool.idle_bytes)

    async def _assemble(
        self, receiver: HandoffReceiver, account: _BufferAccount, chunks: AsyncIterator[bytes]
    ) -> AssembledHandoff:
        metrics = self.metrics
        started = time.monotonic()
        metrics.handoffs_in_flight.inc()
        try:
            async with aclosing(self._paced(chunks)) as paced:
                async for chunk in paced:
                    frames_before = receiver.reader.frames
                    try:
                        receiver.feed(chunk)
                    finally:
                        account.set(receiver.assembler.allocated_bytes)
                        metrics.handoff_received_bytes.inc(len(chunk))
                        metrics.handoff_received_frames.inc(receiver.reader.frames - frames_before)
            handoff = receiver.finish()
        except HandoffError as exc:
            self._failed(exc.code, exc.message)
            raise
        except ClientDisconnect:
            self._failed(CLIENT_DISCONNECTED, "the sender went away mid-handoff")
            raise
        finally:
            metrics.handoffs_in_flight.dec()
        metrics.handoff_receive_seconds.observe(time.monotonic() - started)
        return handoff

    def _failed(self, reason: str, message: str) -> None:
        # The log line carries the request id (x-request-id, set by the AR) through the log filter.
        log.warning("handoff failed (%s): %s", reason, message)
        self.metrics.handoff_failures.labels(reason).inc()

    async def _paced(self, chunks: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
        """The body's chunks, ending the handoff when none arrives within the stall timeout or
        the whole body has not arrived within the deadline."""
        iterator = aiter(chunks)
        deadline = time.monotonic() + self.deadline
        while True:
            left = deadline - time.monotonic()
            try:
                # asyncio.timeout, not wait_for: no task per chunk (a 42 MB body is ~170 chunks).
                async with asyncio.timeout(min(self.stall_timeout, max(0.0, left))):
                    chunk = await anext(iterator)
            except StopAsyncIteration:
                return
            except TimeoutError:
                if left <= self.stall_timeout:
                    raise HandoffDeadlineExceeded(f"the handoff took over {self.deadline:g} s; ended") from None
                raise HandoffStalled(f"no bytes for {self.stall_timeout:g} s; handoff ended") from None
            if chunk:
                yield chunk
