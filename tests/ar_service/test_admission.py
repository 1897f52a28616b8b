"""Admission against the pair's capacity: FIFO waiting, bounded queue and wait, 429 only when full."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from ar_service.admission import RequestAdmission
from ar_service.metrics import ArMetrics
from services.errors import Overloaded


def admission(max_queued: int = 4, max_wait: float = 5.0) -> RequestAdmission:
    return RequestAdmission(max_queued, max_wait, ArMetrics(CollectorRegistry()))


def test_requests_beyond_the_capacity_wait_and_start_in_arrival_order():
    async def scenario():
        gate = admission()
        first = await gate.admit(capacity=1)
        order = []

        async def wait_then_record(name: str):
            ticket = await gate.admit(capacity=1)
            order.append(name)
            await asyncio.sleep(0.01)
            ticket.release()

        waiters = [asyncio.create_task(wait_then_record(n)) for n in "abc"]
        await asyncio.sleep(0.05)
        assert order == [] and gate.in_flight == 1  # all three wait for the one slot
        first.release()
        await asyncio.gather(*waiters)
        return order, gate.in_flight

    assert asyncio.run(scenario()) == (["a", "b", "c"], 0)


def test_a_full_queue_is_refused_at_once_with_retry_after():
    async def scenario():
        gate = admission(max_queued=1)
        held = await gate.admit(capacity=1)
        waiting = asyncio.create_task(gate.admit(capacity=1))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as refused:
            await gate.admit(capacity=1)
        held.release()
        (await waiting).release()
        return refused.value

    refused = asyncio.run(scenario())
    assert refused.status == 429 and int(refused.headers["Retry-After"]) >= 1 and "queue is full" in refused.message


def test_a_wait_longer_than_allowed_at_the_observed_rate_is_refused_before_queueing():
    async def scenario():
        gate = admission(max_queued=100, max_wait=1.0)
        ticket = await gate.admit(capacity=1)
        await asyncio.sleep(0.3)
        ticket.release()  # the pair serves one request per ~0.3 s
        held = await gate.admit(capacity=1)
        queued = [asyncio.create_task(gate.admit(capacity=1)) for _ in range(3)]  # ~0.9 s of waiting
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as refused:
            await gate.admit(capacity=1)  # the fourth would wait ~1.2 s > 1 s
        held.release()
        for task in queued:
            (await task).release()
        return refused.value

    refused = asyncio.run(scenario())
    assert "would be about" in refused.message and refused.headers["Retry-After"] == "2"


def test_a_request_that_waits_past_the_maximum_is_refused_and_leaves_the_queue():
    async def scenario():
        gate = admission(max_wait=0.1)
        held = await gate.admit(capacity=1)
        with pytest.raises(Overloaded, match="no room within"):
            await gate.admit(capacity=1)
        held.release()
        return gate.in_flight

    assert asyncio.run(scenario()) == 0


def test_a_waiter_that_gives_up_passes_its_turn_on():
    async def scenario():
        gate = admission()
        held = await gate.admit(capacity=1)
        leaving = asyncio.create_task(gate.admit(capacity=1))
        staying = asyncio.create_task(gate.admit(capacity=1))
        await asyncio.sleep(0)
        leaving.cancel()  # the client went away while queued
        held.release()
        ticket = await asyncio.wait_for(staying, 1)
        in_flight = gate.in_flight
        ticket.release()
        return in_flight, gate.in_flight

    assert asyncio.run(scenario()) == (1, 0)


def test_capacity_follows_what_the_dit_announces():
    async def scenario():
        gate = admission()
        tickets = [await gate.admit(capacity=3) for _ in range(3)]
        blocked = asyncio.create_task(gate.admit(capacity=3))
        await asyncio.sleep(0.01)
        assert not blocked.done()
        for ticket in tickets:
            ticket.release()
        (await blocked).release()
        return gate.in_flight

    assert asyncio.run(scenario()) == 0
