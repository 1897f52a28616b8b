from __future__ import annotations

import pytest

from dit_service.admission import AdmissionControl
from services.errors import ApiError


def control(**overrides) -> AdmissionControl:
    values = {"max_handoffs": 2, "max_runs": 1, "queue_size": 1, "retry_after_seconds": 3}
    return AdmissionControl(**{**values, **overrides})


def test_handoff_slots_are_bounded_and_refusal_carries_retry_after():
    admission = control()
    with admission.handoff_slot(), admission.handoff_slot(), pytest.raises(ApiError) as refused:  # noqa: SIM117
        with admission.handoff_slot():  # the third one, inside the first two
            pass
    assert refused.value.status == 429 and refused.value.code == "too_many_handoffs"
    assert refused.value.headers == {"Retry-After": "3"}
    with admission.handoff_slot():  # slots come back
        pass


def test_run_tickets_cover_running_plus_queued_and_block_new_handoffs_when_gone():
    admission = control()
    first, second = admission.run_ticket(), admission.run_ticket()
    with pytest.raises(ApiError) as refused:
        admission.run_ticket()
    assert refused.value.code == "pipeline_queue_full"
    with pytest.raises(ApiError), admission.handoff_slot():  # no point receiving rows that could not be rendered
        pass
    first.release()
    first.release()  # idempotent
    third = admission.run_ticket()
    with pytest.raises(ApiError):
        admission.run_ticket()
    second.release()
    third.release()
