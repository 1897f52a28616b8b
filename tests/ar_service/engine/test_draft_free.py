"""With capture on, decode steps schedule no draft token, and every row still arrives. Real vLLM (CPU)."""

from __future__ import annotations

import pytest
from prometheus_client import Counter
from vllm.v1.metrics.loggers import PrometheusStatLogger

from ar_service.engine.hidden_state_engine import HiddenStateEngine
from tests.ar_service.engine.engine_runs import run_engine, token_prompt

pytestmark = pytest.mark.slow


def draft_tokens_scheduled(engine: HiddenStateEngine) -> float:
    """vLLM's own count of draft tokens, from this engine's stat logger (not the process-wide registry,
    which holds whichever engine started last)."""
    manager = engine.vllm.logger_manager
    assert manager is not None, "the engine logs no stats"
    prometheus = next(logger for logger in manager.stat_loggers if isinstance(logger, PrometheusStatLogger))
    counters = prometheus.spec_decoding_prom.counter_spec_decode_num_draft_tokens
    assert counters, "the engine records no draft-token counts: an unchanged total would prove nothing"
    total = 0.0
    for counter in counters.values():
        assert isinstance(counter, Counter)
        total += counter._value.get()
    return total


def test_decoding_schedules_no_draft_tokens_and_streams_every_row(stack):
    engine = stack.runtime.engine
    assert engine.settings.capture_without_draft
    before = draft_tokens_scheduled(engine)
    run = stack.ar.call(run_engine(engine, token_prompt(60, 11), max_new_tokens=12))

    assert len(run.finished.generated_token_ids) == 12
    assert run.finished.row_count == run.rows.shape[0] == 60 + 12 - 1
    assert run.row_token_ids == run.finished.token_ids[:-1]
    # Each of the 11 decode steps would have scheduled one draft token with vLLM's proposer as is.
    assert draft_tokens_scheduled(engine) == before
