"""Admission against the pair's capacity, decided at arrival: FIFO waiting when the measured pace says the
wait fits, 429 at once when it does not; an admitted request is served."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from ar_service import admission as admission_module
from ar_service.admission import RequestAdmission
from ar_service.metrics import ArMetrics
from services.errors import Overloaded


class Clock:
    """The admission's clock, moved by the test: a pace is what the test says it is, however loaded the
    machine (a sleep of 0.2 s took 0.27 s on a busy CI runner)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    async def spend(self, seconds: float) -> None:
        """``seconds`` of work go by, and the event loop runs whatever that let run."""
        self.now += seconds
        await asyncio.sleep(0)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    moved_by_the_test = Clock()
    monkeypatch.setattr(admission_module, "time", moved_by_the_test)
    return moved_by_the_test


def admission(max_queued: int = 4, max_wait: float = 5.0) -> RequestAdmission:
    return RequestAdmission(max_queued, max_wait, ArMetrics(CollectorRegistry()))


async def serve_one(gate: RequestAdmission, clock: Clock, seconds: float, capacity: int = 1) -> None:
    """One request through the gate, taking ``seconds``: the pace is measured from then on."""
    ticket = await gate.enter(capacity=capacity).turn()
    await clock.spend(seconds)
    ticket.release(served=True)


def test_requests_beyond_the_capacity_wait_and_start_in_arrival_order(clock: Clock):
    async def scenario():
        gate = admission()
        await serve_one(gate, clock, 0.01)
        first = await gate.enter(capacity=1).turn()
        order = []

        async def wait_then_record(name: str):
            ticket = await gate.enter(capacity=1).turn()
            order.append(name)
            await clock.spend(0.01)
            ticket.release(served=True)

        waiters = [asyncio.create_task(wait_then_record(n)) for n in "abc"]
        await clock.spend(0.05)
        assert order == [] and gate.in_flight == 1  # all three wait for the one slot
        first.release(served=True)
        await asyncio.gather(*waiters)
        return order, gate.in_flight

    assert asyncio.run(scenario()) == (["a", "b", "c"], 0)


def test_a_full_queue_is_refused_at_once_with_retry_after():
    async def scenario():
        gate = admission(max_queued=1)
        held = await gate.enter(capacity=1).turn()
        waiting = asyncio.create_task(gate.enter(capacity=1).turn())
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as refused:
            await gate.enter(capacity=1).turn()
        held.release(served=True)
        (await waiting).release(served=True)
        return refused.value

    refused = asyncio.run(scenario())
    assert refused.status == 429 and int(refused.headers["Retry-After"]) >= 1 and "queue is full" in refused.message


def test_a_wait_longer_than_allowed_at_the_observed_rate_is_refused_before_queueing(clock: Clock):
    async def scenario():
        gate = admission(max_queued=100, max_wait=1.0)
        await serve_one(gate, clock, 0.3)  # the pair serves one request per ~0.3 s
        held = await gate.enter(capacity=1).turn()
        queued = [asyncio.create_task(gate.enter(capacity=1).turn()) for _ in range(3)]  # ~0.9 s of waiting
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as refused:
            await gate.enter(capacity=1).turn()  # the fourth would wait ~1.2 s > 1 s
        held.release(served=True)
        for task in queued:
            (await task).release(served=True)
        return refused.value

    refused = asyncio.run(scenario())
    assert "would be about" in refused.message and refused.headers["Retry-After"] == "1"


def test_an_admitted_request_is_served_even_when_its_wait_runs_past_the_estimate(clock: Clock):
    async def scenario():
        gate = admission(max_wait=0.2)
        await serve_one(gate, clock, 0.05)
        held = await gate.enter(capacity=1).turn()
        waiting = asyncio.create_task(gate.enter(capacity=1).turn())  # estimated 0.05 s: admitted to the line
        await clock.spend(0.5)  # the one in flight takes ten times longer than the pace said
        assert not waiting.done()  # still in line, not refused after the fact
        held.release(served=True)
        (await asyncio.wait_for(waiting, 1)).release(served=True)
        return gate.in_flight

    assert asyncio.run(scenario()) == 0


def test_before_any_completion_one_round_may_wait_and_the_rest_is_refused_at_once():
    async def scenario():
        gate = admission(max_queued=100)
        held = [await gate.enter(capacity=2).turn() for _ in range(2)]
        line = [asyncio.create_task(gate.enter(capacity=2).turn()) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="not measured yet") as refused:
            await gate.enter(capacity=2).turn()
        for ticket in held:
            ticket.release(served=True)
        for task in line:
            (await task).release(served=True)
        return refused.value

    assert int(asyncio.run(scenario()).headers["Retry-After"]) == 1


def test_the_pace_is_the_time_between_completions_not_a_service_time_divided_by_the_capacity(clock: Clock):
    """Five slots, one request done every 0.1 s (a DiT that renders one run at a time): the line moves
    at 0.1 s a place, however long each request stayed in flight."""

    async def scenario():
        gate = admission(max_queued=100, max_wait=0.45)
        tickets = [await gate.enter(capacity=5).turn() for _ in range(5)]
        for ticket in tickets:
            await clock.spend(0.1)
            ticket.release(served=True)
        held = [await gate.enter(capacity=5).turn() for _ in range(5)]
        line = [asyncio.create_task(gate.enter(capacity=5).turn()) for _ in range(4)]  # 0.1 .. 0.4 s
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="would be about"):
            await gate.enter(capacity=5).turn()  # 0.5 s
        for ticket in held:
            ticket.release(served=True)
        for task in line:
            (await task).release(served=True)
        return gate.in_flight

    assert asyncio.run(scenario()) == 0


def test_the_last_requests_of_a_burst_finishing_together_do_not_make_the_pace_look_faster(clock: Clock):
    """The line moved at 0.1 s a place; then the last four finished at once (the line was gone). A burst
    that follows meets the 0.1 s pace, not a mean pulled down by those zeros."""

    async def scenario():
        gate = admission(max_queued=100)
        tickets = [await gate.enter(capacity=4).turn() for _ in range(4)]
        line = [asyncio.create_task(gate.enter(capacity=4).turn()) for _ in range(3)]
        await asyncio.sleep(0)
        for _ in range(3):
            await clock.spend(0.1)
            tickets.pop(0).release(served=True)
            tickets.append(await line.pop(0))
        for ticket in tickets:  # the drain: four at once
            ticket.release(served=True)
        return gate.pace

    assert asyncio.run(scenario()) == pytest.approx(0.1)


def test_requests_that_fail_or_are_abandoned_do_not_make_the_pace_look_faster(clock: Clock):
    async def scenario():
        gate = admission()
        await serve_one(gate, clock, 0.2)
        for _ in range(10):  # quick failures: 400s from the DiT, clients that left
            (await gate.enter(capacity=1).turn()).release(served=False)
        return gate.pace

    assert asyncio.run(scenario()) == pytest.approx(0.2)


def test_a_waiter_that_gives_up_passes_its_turn_on(clock: Clock):
    async def scenario():
        gate = admission()
        await serve_one(gate, clock, 0.01)
        held = await gate.enter(capacity=1).turn()
        leaving = asyncio.create_task(gate.enter(capacity=1).turn())
        staying = asyncio.create_task(gate.enter(capacity=1).turn())
        await asyncio.sleep(0)
        leaving.cancel()  # the client went away while queued
        held.release(served=True)
        ticket = await asyncio.wait_for(staying, 1)
        in_flight = gate.in_flight
        ticket.release(served=True)
        return in_flight, gate.in_flight

    assert asyncio.run(scenario()) == (1, 0)


def test_capacity_follows_what_the_dit_announces(clock: Clock):
    async def scenario():
        gate = admission()
        tickets = [await gate.enter(capacity=3).turn() for _ in range(3)]
        blocked = asyncio.create_task(gate.enter(capacity=3).turn())
        await clock.spend(0.01)
        assert not blocked.done()
        for ticket in tickets:
            ticket.release(served=True)
        (await blocked).release(served=True)
        return gate.in_flight

    assert asyncio.run(scenario()) == 0


def test_a_place_given_up_before_its_turn_lets_the_line_move_on(clock: Clock):
    async def scenario():
        gate = admission()
        await serve_one(gate, clock, 0.01)
        held = await gate.enter(capacity=1).turn()
        invalid, next_in_line = gate.enter(capacity=1), gate.enter(capacity=1)
        held.release(served=True)  # the slot goes to `invalid` while it is being validated...
        assert invalid.started
        invalid.leave()  # ...which is refused (a 400): the slot passes on
        assert next_in_line.started
        (await next_in_line.turn()).release(served=True)
        return gate.in_flight

    assert asyncio.run(scenario()) == 0
