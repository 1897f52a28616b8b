"""A DiT's places: bounded, taken by a reservation or by a handoff, given back once, lapsing when unused."""

from __future__ import annotations

import asyncio

import pytest

from dit_service.admission import AdmissionControl
from services.errors import ApiError
from tests.support.waiting import until


def control(**overrides) -> AdmissionControl:
    values = {"max_handoffs": 8, "max_runs": 1, "queue_size": 1, "retry_after_seconds": 3, "reservation_seconds": 30}
    return AdmissionControl(**{**values, **overrides})


def test_places_are_the_fewer_of_handoffs_and_runs_plus_queue_and_refusal_carries_retry_after():
    async def scenario():
        admission = control()
        first, second = admission.place(None), admission.place(None)
        with pytest.raises(ApiError) as refused:
            admission.place(None)
        first.release()
        first.release()  # idempotent
        third = admission.place(None)
        second.release()
        third.release()
        return admission.places, refused.value, admission.taken

    places, refused, taken = asyncio.run(scenario())
    assert places == 2 and taken == 0
    assert refused.status == 429 and refused.code == "dit_full" and refused.headers == {"Retry-After": "3"}
    assert control(max_handoffs=1, queue_size=4).places == 1


def test_a_reservation_holds_a_place_that_its_handoff_takes_and_no_other_can():
    async def scenario():
        admission = control(queue_size=0)  # one place
        reservation = admission.reserve()
        with pytest.raises(ApiError):
            admission.place(None)  # held for the reservation
        with pytest.raises(ApiError):
            admission.reserve()
        place = admission.place(reservation)  # the handoff that names it gets it, whatever else is full
        with pytest.raises(ApiError):
            admission.place(reservation)  # used once
        place.release()
        return admission.taken

    assert asyncio.run(scenario()) == 0


def test_an_unused_reservation_lapses_and_its_place_comes_back():
    async def scenario():
        admission = control(queue_size=0, reservation_seconds=0.05)
        reservation = admission.reserve()
        await until(lambda: admission.taken == 0, what="the reservation lapsed")
        other = admission.place(None)  # the place is free again, and someone else takes it
        with pytest.raises(ApiError):
            admission.place(reservation)  # lapsed: a handoff like any other, and there is no free place
        other.release()

    asyncio.run(scenario())
