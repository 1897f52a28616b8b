"""Admission against the pair's capacity, decided at arrival and priced by work: a place in line when the wait
(the work admitted ahead, at the pace) fits, 429 at once when it does not; an admitted request is served. The line
is first come first served; with API keys, keys take turns in it where every request passed can afford it.
Requests here are one unit of work each unless a test says otherwise."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import CollectorRegistry

from ar_service import admission as admission_module
from ar_service.admission import AdmissionPlace, RequestAdmission
from ar_service.metrics import ArMetrics
from services.errors import Overloaded
from shared.capabilities import Load, Pace


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


def units(work: float) -> Load:
    """One request of ``work`` units of denoising, on images of no size to speak of."""
    return Load(1, 0.0, work)


def admission(max_queued: int = 4, max_wait: float = 5.0) -> RequestAdmission:
    return RequestAdmission(max_queued, max_wait, ArMetrics(CollectorRegistry()))


async def serve_one(gate: RequestAdmission, clock: Clock, seconds: float, capacity: int = 1, work: float = 1.0):
    """One request through the gate, taking ``seconds``: the pace is measured from then on."""
    ticket = await gate.enter(capacity, units(work)).turn()
    await clock.spend(seconds)
    ticket.release(served=True)


async def release_all(tickets, tasks) -> None:
    for ticket in tickets:
        ticket.release(served=True)
    for task in tasks:
        (await task).release(served=True)


def test_requests_beyond_the_capacity_wait_and_start_in_arrival_order(clock: Clock):
    async def scenario():
        gate = admission()
        await serve_one(gate, clock, 0.01)
        first = await gate.enter(1, units(1.0)).turn()
        order = []

        async def wait_then_record(name: str):
            ticket = await gate.enter(1, units(1.0)).turn()
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
        held = await gate.enter(1, units(1.0)).turn()
        waiting = asyncio.create_task(gate.enter(1, units(1.0)).turn())
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as refused:
            await gate.enter(1, units(1.0)).turn()
        await release_all([held], [waiting])
        return refused.value

    refused = asyncio.run(scenario())
    assert refused.status == 429 and int(refused.headers["Retry-After"]) >= 1 and "queue is full" in refused.message


def test_a_wait_past_max_wait_at_the_measured_pace_is_refused_before_queueing(clock: Clock):
    async def scenario():
        gate = admission(max_queued=100, max_wait=1.0)
        await serve_one(gate, clock, 0.3)  # the pair does one unit of work in ~0.3 s
        held = await gate.enter(1, units(1.0)).turn()
        queued = [asyncio.create_task(gate.enter(1, units(1.0)).turn()) for _ in range(3)]  # waits of 0.3, 0.6, 0.9 s
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as refused:
            await gate.enter(1, units(1.0)).turn()  # four units ahead: ~1.2 s > 1 s
        await release_all([held], queued)
        return refused.value

    refused = asyncio.run(scenario())
    assert "would be about" in refused.message and refused.headers["Retry-After"] == "1"


def test_heavy_requests_after_light_traffic_are_priced_by_their_work(clock: Clock):
    """Light requests (one unit) measure the pace; then requests of 40 units each: the first few fit the wait, the
    next is refused at once, where pricing every request alike would have admitted them all."""

    async def scenario():
        gate = admission(max_queued=100, max_wait=12.0)
        for _ in range(3):
            await serve_one(gate, clock, 0.125)  # 0.125 s a unit
        admitted = [gate.enter(5, units(40.0)) for _ in range(3)]  # renders start at 0, 5 and 10 s
        with pytest.raises(Overloaded, match="would be about 15 s") as refused:
            gate.enter(5, units(40.0))
        for place in admitted:
            place.leave()
        return refused.value

    assert asyncio.run(scenario()).headers["Retry-After"] == "3"


def test_a_request_priced_as_the_default_and_then_as_what_it_asks_counts_for_those_after_it(clock: Clock):
    async def scenario():
        gate = admission(max_queued=100, max_wait=10.0)
        await serve_one(gate, clock, 0.1)
        heavy = gate.enter(5, units(1.0))  # taken at the door, priced as the default request
        heavy.price(units(120.0))  # its body read: 12 s of work
        with pytest.raises(Overloaded):
            gate.enter(5, units(1.0))  # it would start after 12 s
        heavy.leave()
        gate.enter(5, units(1.0)).leave()  # with it gone, nothing is ahead

    asyncio.run(scenario())


def test_a_free_slot_does_not_admit_a_request_whose_render_would_start_past_the_wait(clock: Clock):
    """Five slots, but the DiT renders one run at a time: four heavy requests in flight make the fifth wait for
    them at the DiT, slot or no slot."""

    async def scenario():
        gate = admission(max_queued=100, max_wait=10.0)
        await serve_one(gate, clock, 0.1)
        in_flight = [gate.enter(5, units(30.0)) for _ in range(4)]  # 12 s of work
        assert all(place.started for place in in_flight)
        with pytest.raises(Overloaded):
            gate.enter(5, units(1.0))
        for place in in_flight:
            place.leave()

    asyncio.run(scenario())


def test_before_any_completion_the_dits_announced_pace_prices_a_fresh_pairs_first_burst(clock: Clock):
    """16 requests at once on a fresh pair of 5 slots: the DiTs' warm-up pace prices them, and every one fits."""

    async def scenario():
        gate = admission(max_queued=256, max_wait=120.0)
        places = [
            gate.enter(5, units(0.1), announced_pace=Pace(per_request=0.0, per_work=0.5)) for _ in range(16)
        ]  # 0.05 s each: 0.75 s at most
        started = sum(place.started for place in places)
        for place in places:
            place.leave()
        return started, gate.pace

    assert asyncio.run(scenario()) == (5, Pace(per_request=0.0, per_work=0.5))


def test_without_an_announced_pace_one_round_may_wait_before_any_completion_and_the_rest_is_refused():
    async def scenario():
        gate = admission(max_queued=100)
        held = [await gate.enter(2, units(1.0)).turn() for _ in range(2)]
        line = [asyncio.create_task(gate.enter(2, units(1.0)).turn()) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="not measured yet") as refused:
            await gate.enter(2, units(1.0)).turn()
        await release_all(held, line)
        return refused.value

    assert int(asyncio.run(scenario()).headers["Retry-After"]) == 1


def test_the_measured_pace_is_the_announced_split_scaled_to_what_the_pair_took(clock: Clock):
    """The warm-up said a request costs 1 s, a megapixel 2 s and a unit of denoising 5 s; the pair then served one of
    12 s by that count in 0.6 s (batches, another machine): every part is a twentieth."""
    announced = Pace(per_request=1.0, per_megapixel=2.0, per_work=5.0)

    async def scenario():
        gate = admission()
        gate.enter(1, units(1.0), announced_pace=announced).leave()
        before = gate.pace
        ticket = await gate.enter(1, Load(1, 0.5, 2.0)).turn()
        await clock.spend(0.6)
        ticket.release(served=True)
        return before, gate.pace

    before, after = asyncio.run(scenario())
    assert before == announced
    assert after is not None
    assert (after.per_request, after.per_megapixel, after.per_work) == pytest.approx((0.05, 0.1, 0.25))


def test_a_request_of_many_megapixels_and_few_steps_is_priced_by_its_megapixels_too(clock: Clock):
    """Default requests measure the pace; then one of a few steps at a large size, whose VAE outweighs its
    denoising, is priced by both: the request after it would wait for the VAE too, and is refused."""
    announced = Pace(per_request=0.0, per_megapixel=1.0, per_work=0.1)

    async def scenario():
        gate = admission(max_queued=100, max_wait=5.0)
        gate.enter(1, units(1.0), announced_pace=announced).leave()
        for _ in range(3):
            await serve_one(gate, clock, 0.2, work=1.0)  # a unit of denoising, no megapixels: the scale is 2
        large = gate.enter(5, Load(1, 4.0, 4.0))  # 4 s of VAE and 0.4 s of denoising at the announced split: x2
        with pytest.raises(Overloaded, match="would be about 9 s"):
            gate.enter(5, units(1.0))
        large.leave()

    asyncio.run(scenario())


def test_the_pace_is_the_time_between_completions_not_a_service_time_divided_by_the_capacity(clock: Clock):
    """Five slots, one request done every 0.1 s (a DiT that renders one run at a time): 0.1 s a unit, however
    long each request stayed in flight."""

    async def scenario():
        gate = admission(max_queued=100)
        tickets = [await gate.enter(5, units(1.0)).turn() for _ in range(5)]
        for ticket in tickets:
            await clock.spend(0.1)
            ticket.release(served=True)
        return gate.pace

    assert asyncio.run(scenario()).per_work == pytest.approx(0.1)


def test_the_last_requests_of_a_burst_finishing_together_do_not_make_the_pace_look_faster(clock: Clock):
    """The line moved at 0.1 s a unit; then the last four finished at once (the line was gone). A burst that
    follows meets the 0.1 s pace, not a mean pulled down by those zeros."""

    async def scenario():
        gate = admission(max_queued=100)
        tickets = [await gate.enter(4, units(1.0)).turn() for _ in range(4)]
        line = [asyncio.create_task(gate.enter(4, units(1.0)).turn()) for _ in range(3)]
        await asyncio.sleep(0)
        for _ in range(3):
            await clock.spend(0.1)
            tickets.pop(0).release(served=True)
            tickets.append(await line.pop(0))
        for ticket in tickets:  # the drain: four at once
            ticket.release(served=True)
        return gate.pace

    assert asyncio.run(scenario()).per_work == pytest.approx(0.1)


def test_requests_that_fail_or_are_abandoned_do_not_make_the_pace_look_faster(clock: Clock):
    async def scenario():
        gate = admission()
        await serve_one(gate, clock, 0.2)
        for _ in range(10):  # quick failures: 400s from the DiT, clients that left
            (await gate.enter(1, units(1.0)).turn()).release(served=False)
        return gate.pace

    assert asyncio.run(scenario()).per_work == pytest.approx(0.2)


def test_a_waiter_that_gives_up_passes_its_turn_on(clock: Clock):
    async def scenario():
        gate = admission()
        await serve_one(gate, clock, 0.01)
        held = await gate.enter(1, units(1.0)).turn()
        leaving = asyncio.create_task(gate.enter(1, units(1.0)).turn())
        staying = asyncio.create_task(gate.enter(1, units(1.0)).turn())
        await asyncio.sleep(0)
        leaving.cancel()  # the client went away while queued
        held.release(served=True)
        ticket = await asyncio.wait_for(staying, 1)
        in_flight = gate.in_flight
        ticket.release(served=True)
        return in_flight, gate.in_flight, gate.estimated_wait()

    assert asyncio.run(scenario()) == (1, 0, 0.0)


def test_capacity_follows_what_the_dit_announces(clock: Clock):
    async def scenario():
        gate = admission()
        await serve_one(gate, clock, 0.01)
        tickets = [await gate.enter(3, units(1.0)).turn() for _ in range(3)]
        blocked = asyncio.create_task(gate.enter(3, units(1.0)).turn())
        await clock.spend(0.01)
        assert not blocked.done()
        await release_all(tickets, [blocked])
        return gate.in_flight

    assert asyncio.run(scenario()) == 0


def test_a_place_given_up_before_its_turn_lets_the_line_move_on(clock: Clock):
    async def scenario():
        gate = admission()
        await serve_one(gate, clock, 0.01)
        held = await gate.enter(1, units(1.0)).turn()
        invalid, next_in_line = gate.enter(1, units(1.0)), gate.enter(1, units(1.0))
        held.release(served=True)  # the slot goes to `invalid` while it is being validated...
        assert invalid.started
        invalid.leave()  # ...which is refused (a 400): the slot passes on
        assert next_in_line.started
        (await next_in_line.turn()).release(served=True)
        return gate.in_flight, gate.estimated_wait()

    assert asyncio.run(scenario()) == (0, 0.0)


def test_a_burst_of_heavy_requests_priced_as_the_default_at_the_door_is_refused_past_the_wait_once_priced(
    clock: Clock,
):
    """Five heavy requests arrive together, each taken at the door as a default one (one unit); priced in arrival
    order at 40 units each, the ones whose render would start past the wait are refused then, before any work."""

    async def scenario():
        gate = admission(max_queued=100, max_wait=12.0)
        await serve_one(gate, clock, 0.125)  # 0.125 s a unit
        places = [gate.enter(5, units(1.0)) for _ in range(5)]  # all fit, priced as the default
        outcomes = []
        for place in places:
            try:
                place.price(units(40.0))  # 5 s each
                outcomes.append("admitted")
            except Overloaded as refused:
                place.leave()
                outcomes.append(refused.message.split(";")[0])
        for place in places:
            place.leave()
        return outcomes, gate.estimated_wait()

    outcomes, wait_after = asyncio.run(scenario())
    assert outcomes == ["admitted"] * 3 + ["too many image requests: the wait would be about 15 s, over 12 s"] * 2
    assert wait_after == 0.0


def test_an_unread_request_is_priced_as_the_default_until_requests_are_read_then_as_they_asked_on_average(
    clock: Clock,
):
    """The model's default is 40 units, its users ask 1 or 3. A burst of ten unread requests after traffic like
    that is priced at 2 units each and all fit the wait; priced at the default, all but the first three would have
    been refused at the door for work nobody asked for. Traffic heavier than the default leaves the default."""

    async def scenario():
        gate = admission(max_queued=100, max_wait=12.0)
        default = units(40.0)
        before_any = gate.unread_load(default)
        for work in (1.0, 3.0):
            place = gate.enter(5, gate.unread_load(default))
            place.price(units(work))
            ticket = await place.turn()
            await clock.spend(0.125 * work)  # 0.125 s a unit
            ticket.release(served=True)
        burst = [gate.enter(5, gate.unread_load(default)) for _ in range(10)]  # 2.5 s of work at most
        priced_as = burst[-1].load
        for place in burst:
            place.leave()
        for _ in range(32):
            heavy = gate.enter(5, gate.unread_load(default))
            heavy.price(units(400.0))
            heavy.leave()
        return before_any, priced_as, gate.unread_load(default)

    assert asyncio.run(scenario()) == (units(40.0), units(2.0), units(40.0))


def test_an_unread_request_priced_too_low_is_still_refused_past_the_wait_once_read(clock: Clock):
    async def scenario():
        gate = admission(max_queued=100, max_wait=12.0)
        place = gate.enter(5, units(1.0))
        place.price(units(1.0))
        await clock.spend(0.125)
        (await place.turn()).release(served=True)
        burst = [gate.enter(5, gate.unread_load(units(40.0))) for _ in range(5)]  # all fit at 1 unit each
        outcomes = []
        for place in burst:
            try:
                place.price(units(40.0))
                outcomes.append("admitted")
            except Overloaded:
                place.leave()
                outcomes.append("refused")
        for place in burst:
            place.leave()
        return outcomes

    assert asyncio.run(scenario()) == ["admitted"] * 3 + ["refused"] * 2


def test_with_keys_a_flooding_key_holds_its_share_and_another_keys_request_is_admitted_behind_only_that(
    clock: Clock,
):
    """Key A sends twenty requests of a second each; with a 4 s share per key, A's requests past 4 s of work in
    line are refused when priced, and key B's one request, arriving after them all, waits behind A's share
    only (within the 10 s the whole line may hold)."""

    async def scenario():
        gate = RequestAdmission(100, 10.0, ArMetrics(CollectorRegistry()), max_key_wait=4.0)
        await serve_one(gate, clock, 1.0)  # a second a request
        outcomes = []
        held = []
        for _ in range(20):
            place = gate.enter(1, units(1.0))
            try:
                place.price(units(1.0), "a")
                outcomes.append("admitted")
                held.append(place)
            except Overloaded as refused:
                place.leave()
                outcomes.append(refused.message.split(";")[0])
        b = gate.enter(1, units(1.0))
        b.price(units(1.0), "b")
        wait_for_b = gate.pace.seconds(sum((p.load for p in held), start=Load()))  # type: ignore[union-attr]
        for place in (*held, b):
            place.leave()
        return outcomes, wait_for_b

    outcomes, wait_for_b = asyncio.run(scenario())
    refusal = (
        "too many image requests: this API key's requests in line would hold about 5 s of work, over its share of 4 s"
    )
    assert outcomes == ["admitted"] * 4 + [refusal] * 16
    assert wait_for_b == 4.0


def test_without_keys_no_share_applies():
    async def scenario():
        gate = RequestAdmission(100, 10.0, ArMetrics(CollectorRegistry()), max_key_wait=4.0)
        places = [gate.enter(1, units(1.0), Pace(per_request=1.0, per_work=0.0)) for _ in range(8)]
        for place in places:
            place.price(units(1.0), None)
        for place in places:
            place.leave()

    asyncio.run(scenario())


def test_a_key_may_always_have_one_request_however_heavy():
    async def scenario():
        gate = RequestAdmission(100, 100.0, ArMetrics(CollectorRegistry()), max_key_wait=4.0)
        first = gate.enter(1, units(1.0), Pace(per_request=0.0, per_work=1.0))
        first.price(units(50.0), "a")  # alone over its key's share
        second = gate.enter(1, units(1.0), Pace(per_request=0.0, per_work=1.0))
        with pytest.raises(Overloaded):
            second.price(units(1.0), "a")
        second.leave()
        first.leave()

    asyncio.run(scenario())


def priced_from_key_a(places: list[AdmissionPlace], order: list[AdmissionPlace]) -> list[str]:
    """Each of ``places`` priced at a unit from key "a", in ``order``: admitted, or refused (and given up); then all
    given up."""
    outcomes = []
    for place in order:
        try:
            place.price(units(1.0), "a")
            outcomes.append("admitted")
        except Overloaded:
            place.leave()
            outcomes.append("refused")
    for place in places:
        place.leave()
    return outcomes


def test_a_keys_share_counts_its_places_whichever_order_their_bodies_were_priced_in():
    async def scenario():
        gate = RequestAdmission(100, 100.0, ArMetrics(CollectorRegistry()), max_key_wait=4.0)
        places = [gate.enter(1, units(1.0), Pace(per_request=0.0, per_work=1.0)) for _ in range(6)]
        return priced_from_key_a(places, places[::-1])  # the last to arrive is the first whose body is read

    assert asyncio.run(scenario()) == ["admitted"] * 4 + ["refused"] * 2


def test_a_keys_share_counts_its_places_at_their_prices_not_its_unread_ones_at_a_guess():
    """Six requests of a unit each arrive from one key with a 4-unit share, priced at the door at a guess of ten
    units each (the default request can be many times what users ask): four are admitted as they are priced, as
    their real prices fit the share whatever the guesses of the unread ones say."""

    async def scenario():
        gate = RequestAdmission(100, 100.0, ArMetrics(CollectorRegistry()), max_key_wait=4.0)
        places = [gate.enter(1, units(10.0), Pace(per_request=0.0, per_work=1.0), tenant="a") for _ in range(6)]
        return priced_from_key_a(places, places)

    assert asyncio.run(scenario()) == ["admitted"] * 4 + ["refused"] * 2


def keyed(max_wait: float = 100.0, max_key_wait: float | None = 100.0) -> RequestAdmission:
    """An admission with API keys on, whose line holds a hundred requests."""
    return RequestAdmission(100, max_wait, ArMetrics(CollectorRegistry()), max_key_wait=max_key_wait)


def sent(gate: RequestAdmission, key: str, work: float = 1.0, capacity: int = 1) -> AdmissionPlace:
    """A request of ``work`` units from ``key``'s API key, taken at the door and priced as serving prices it
    (refused then, it gives its place back)."""
    place = gate.enter(capacity, units(work), A_UNIT_A_SECOND, key)
    try:
        place.price(units(work), key)
    except Overloaded:
        place.leave()
        raise
    return place


# What a unit of work costs, as a DiT announces it: the tests' clock moves by as much for each request served.
A_UNIT_A_SECOND = Pace(per_request=0.0, per_work=1.0)


async def served_in_turn(clock: Clock, places: dict[str, AdmissionPlace]) -> list[str]:
    """The places, named, served one at a time (a slot of one) until none is left: each takes its work's seconds
    at a unit a second. The names in the order their requests started."""
    order: list[str] = []
    while len(order) < len(places):
        [(name, place)] = [(name, p) for name, p in places.items() if p.started and name not in order]
        order.append(name)
        ticket = await place.turn()
        await clock.spend(place.load.work)
        ticket.release(served=True)
    return order


def test_with_keys_another_keys_request_takes_the_next_turn_ahead_of_a_flooding_keys_line(clock: Clock):
    """Key A's requests hold the slot and four places in line; key B's one request, sent after them all, starts
    when the slot frees, before A's second: A has started a request since B last did."""

    async def scenario() -> list[str]:
        gate = keyed()
        places = {f"a{i}": sent(gate, "a") for i in range(5)}
        places["b"] = sent(gate, "b")
        return await served_in_turn(clock, places)

    assert asyncio.run(scenario()) == ["a0", "b", "a1", "a2", "a3", "a4"]


def test_with_keys_keys_take_turns_in_line_and_each_keys_requests_keep_their_order(clock: Clock):
    """A holds the slot and three places in line, then B sends two requests and C one. As the slot frees, each key
    starts its oldest in turn, the key that started one least lately first: B and C before A's second."""

    async def scenario() -> list[str]:
        gate = keyed()
        places = {"a0": sent(gate, "a")}
        places |= {f"a{i}": sent(gate, "a") for i in range(1, 4)}
        places |= {f"b{i}": sent(gate, "b") for i in range(2)}
        places["c0"] = sent(gate, "c")
        return await served_in_turn(clock, places)

    assert asyncio.run(scenario()) == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]


@pytest.mark.parametrize(("work", "starts_after"), [(5.0, "a0"), (7.0, "a4")])
def test_a_turn_is_taken_only_where_every_request_passed_still_starts_within_the_wait(
    clock: Clock, work: float, starts_after: str
):
    """The wait is 10 s at a unit a second; A's last request in line waits for 4 s of work ahead of it. B's
    request of 5 units may pass A's four in line (the last then waits 9 s); one of 7 units would make it wait
    11 s, so it waits for its turn in arrival order instead, and A's requests all start within their wait."""

    async def scenario() -> list[str]:
        gate = keyed(max_wait=10.0)
        places = {f"a{i}": sent(gate, "a") for i in range(5)}
        places["b"] = sent(gate, "b", work)
        return await served_in_turn(clock, places)

    order = asyncio.run(scenario())
    assert order.index("b") == order.index(starts_after) + 1


def test_a_request_whose_body_is_not_read_yet_is_not_passed(clock: Clock):
    """A's second request waits in line priced as the door guessed, its body unread: what its render waits for is
    not known yet, so B's request, whose turn it is, does not pass it."""

    async def scenario() -> list[str]:
        gate = keyed()
        places = {"a0": sent(gate, "a"), "a1 unread": gate.enter(1, units(1.0), A_UNIT_A_SECOND, "a")}
        places["b"] = sent(gate, "b")
        return await served_in_turn(clock, places)

    assert asyncio.run(scenario()) == ["a0", "a1 unread", "b"]


def test_with_keys_taking_turns_every_request_admitted_starts_within_the_wait(clock: Clock):
    """Three keys send requests of 1 to 8 units at random moments (a fixed seed), key A ten times as often as the
    others, to a pair that serves one request at a time at a unit a second. Keys take turns in line, and turns are
    taken; every request admitted starts within the 30 s promised, counted from its arrival."""
    chance = random.Random(58)
    arrivals = sorted((chance.uniform(0, 600), chance.choice("aaaaaaaaaabc"), chance.randint(1, 8)) for _ in range(400))

    async def scenario() -> tuple[list[float], int]:
        gate = keyed(max_wait=30.0, max_key_wait=20.0)
        start = clock.now
        waits, passed = [], 0
        line: dict[AdmissionPlace, float] = {}  # admitted, not started: when each arrived
        running: tuple[AdmissionPlace, float] | None = None  # and when it ends
        while arrivals or line or running:
            ends = running[1] if running else float("inf")
            if arrivals and start + arrivals[0][0] < ends:
                at, key, work = arrivals.pop(0)
                clock.now = start + at
                try:
                    line[sent(gate, key, work)] = clock.now
                except Overloaded:
                    continue
            else:
                assert running is not None, "requests wait in line while the slot is free"
                clock.now = ends
                (await running[0].turn()).release(served=True)
                running = None
            for place in [place for place in line if place.started]:
                arrived = line.pop(place)
                passed += sum(other < arrived for other in line.values())
                waits.append(clock.now - arrived)
                running = (place, clock.now + place.load.work)
        return waits, passed

    waits, passed = asyncio.run(scenario())
    assert len(waits) > 100 and passed > 0
    assert max(waits) <= 30.0
