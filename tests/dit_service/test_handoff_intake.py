"""The intake alone (no server, no model): stall timeout, open-frame check, buffer accounting."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from dit_service.handoff_intake import HandoffIntake
from dit_service.metrics import DitMetrics
from shared.errors import ConditioningMismatch, HandoffAborted, HandoffDeadlineExceeded, HandoffStalled
from shared.frame_codec import FrameLimits
from shared.handoff_assembler import AssemblyCaps
from shared.handoff_encoder import HandoffEncoder
from shared.row_buffer_pool import RowBufferPool
from tests.dit_service.handoff_requests import complete_handoff, hidden_rows, open_frame, token_ids

ROW_BYTES = 576 * 4


def intake(
    metrics: DitMetrics, stall: float = 5.0, pool: RowBufferPool | None = None, deadline: float = 60.0
) -> HandoffIntake:
    return HandoffIntake(AssemblyCaps(), FrameLimits(), stall, deadline, metrics, pool)


async def chunks_of(parts, pause_after: int | None = None, trickle: float = 0.0):
    for index, part in enumerate(parts):
        yield part
        if index == pause_after:
            await asyncio.sleep(3600)
        await asyncio.sleep(trickle)


def test_a_sender_that_trickles_within_the_stall_timeout_still_meets_the_deadline():
    metrics = DitMetrics(CollectorRegistry())
    encoder = HandoffEncoder(open_frame(5))
    parts = [bytes(b) for b in encoder.open_frame() + encoder.rows("cond", 0, token_ids(2), hidden_rows(2))]
    one_byte_at_a_time = [part[i : i + 1] for part in parts for i in range(len(part))]

    async def run():
        started = time.monotonic()
        with pytest.raises(HandoffDeadlineExceeded):
            async with intake(metrics, stall=0.2, deadline=0.5).receive(
                chunks_of(one_byte_at_a_time, trickle=0.05), lambda frame: None
            ):
                pass
        return time.monotonic() - started

    assert asyncio.run(run()) < 1.0
    assert gauge(metrics, "handoff_buffer_bytes") == 0 and gauge(metrics, "handoffs_in_flight") == 0
    assert metrics.handoff_failures.labels("handoff_deadline_exceeded")._value.get() == 1


def gauge(metrics: DitMetrics, name: str) -> float:
    return getattr(metrics, name)._value.get()


def test_the_handoff_comes_with_what_the_check_of_its_open_frame_answered():
    async def run():
        opened = chunks_of(complete_handoff(hidden_rows(2)))
        async with intake(DitMetrics(CollectorRegistry())).receive(opened, lambda frame: frame.request_id) as received:
            assert received.accepted == received.handoff.open.request_id

    asyncio.run(run())


def test_rows_are_accounted_while_held_and_released_after():
    metrics = DitMetrics(CollectorRegistry())

    async def run():
        async with intake(metrics).receive(chunks_of(complete_handoff(hidden_rows(5))), lambda frame: None) as received:
            assert received.handoff.streams["cond"].rows.shape == (5, 576)
            assert gauge(metrics, "handoff_buffer_bytes") == 5 * ROW_BYTES
            assert gauge(metrics, "handoffs_in_flight") == 0  # received; only held now

    asyncio.run(run())
    assert gauge(metrics, "handoff_buffer_bytes") == 0
    assert metrics.handoff_received_frames._value.get() == 3
    assert metrics.handoff_receive_seconds._sum.get() > 0


def test_a_stall_ends_the_handoff_and_releases_its_rows():
    metrics = DitMetrics(CollectorRegistry())
    encoder = HandoffEncoder(open_frame(5))
    parts = [bytes(b) for b in encoder.open_frame() + encoder.rows("cond", 0, token_ids(2), hidden_rows(2))]

    async def run():
        async with intake(metrics, stall=0.1).receive(chunks_of(parts, pause_after=1), lambda frame: None):
            pass

    with pytest.raises(HandoffStalled):
        asyncio.run(run())
    assert gauge(metrics, "handoff_buffer_bytes") == 0
    assert gauge(metrics, "handoffs_in_flight") == 0
    assert metrics.handoff_failures.labels("handoff_stalled")._value.get() == 1


def test_open_is_checked_when_it_arrives_and_a_refusal_releases_the_rows():
    metrics = DitMetrics(CollectorRegistry())
    seen = []

    def refuse(frame):
        seen.append(frame.request_id)
        raise ConditioningMismatch("no", param="hidden_size")

    async def run():
        async with intake(metrics).receive(chunks_of(complete_handoff(hidden_rows(5))), refuse):
            pass

    with pytest.raises(ConditioningMismatch):
        asyncio.run(run())
    assert seen == ["req_test"]
    assert gauge(metrics, "handoff_buffer_bytes") == 0
    assert metrics.handoff_failures.labels("conditioning_mismatch")._value.get() == 1


def test_released_buffers_stay_warm_in_the_pool_and_are_reused():
    metrics = DitMetrics(CollectorRegistry())
    pool = RowBufferPool(max_idle_bytes=1 << 20)
    encoder = HandoffEncoder(open_frame(5))
    aborted = [bytes(b) for b in encoder.open_frame() + encoder.abort("engine died")]

    async def run(parts):
        async with intake(metrics, pool=pool).receive(chunks_of(parts), lambda frame: None):
            pass

    with pytest.raises(HandoffAborted):
        asyncio.run(run(aborted))
    assert gauge(metrics, "handoff_buffer_bytes") == 0
    assert gauge(metrics, "handoff_buffer_idle_bytes") == 5 * ROW_BYTES
    asyncio.run(run(complete_handoff(hidden_rows(5))))
    assert pool.in_use_bytes == 0 and pool.idle_bytes == 5 * ROW_BYTES
