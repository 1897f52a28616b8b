"""Serving's failure table: what goes wrong below the public API, as OpenAI-shaped errors."""

from __future__ import annotations

import pytest

from ar_service.api.serving import map_failures
from ar_service.engine.hidden_state_engine import EngineUnavailable
from ar_service.engine.row_channel import RowQueueOverflow
from ar_service.handoff_client import DitBusy, DitRejected, DitUnavailable
from services.errors import ApiError


@pytest.mark.parametrize(
    ("failure", "status", "code"),
    [
        (EngineUnavailable("died"), 503, "engine_unavailable"),
        (DitRejected(422, "bad size", "invalid_diffusion_params", "size"), 400, "invalid_diffusion_params"),
        (DitRejected(422, "wrong model", "conditioning_mismatch", "model"), 502, "conditioning_mismatch"),
        (DitRejected(400, "bad frame", "malformed_frame", None), 502, "malformed_frame"),
        (DitBusy("queue full", retry_after="3"), 429, "dit_busy"),
        (DitUnavailable("gone"), 503, "dit_unavailable"),
        (RowQueueOverflow("slow"), 503, "handoff_backpressure"),
    ],
)
def test_failures_below_the_api_map_to_openai_errors(failure, status, code):
    with pytest.raises(ApiError) as info, map_failures():
        raise failure
    assert (info.value.status, info.value.code) == (status, code)
    if status in (429, 503):
        assert int(info.value.headers["Retry-After"]) >= 1


def test_anything_unmapped_passes_through():
    with pytest.raises(KeyError), map_failures():
        raise KeyError("not ours")
