"""On CPU the engine's worker keeps one packed matmul copy of the vocabulary matrix, the LM head's: the
input embedding's, which only looks rows up, is released when the service starts its engine."""

from __future__ import annotations

import pytest

from tests.ar_service.engine.engine_runs import run_engine, token_prompt

pytestmark = pytest.mark.slow


def test_the_service_released_the_input_embeddings_copy_the_size_of_the_vocabulary_matrix(stack):
    engine = stack.runtime.engine
    model = engine.vllm.vllm_config.model_config
    vocabulary = model.get_vocab_size() * model.get_hidden_size() * engine.dtype.itemsize
    # vLLM pads the vocabulary to a multiple of 64 rows for its matmuls.
    padded = -(-model.get_vocab_size() // 64) * 64 * model.get_hidden_size() * engine.dtype.itemsize
    assert engine.released_bytes in {vocabulary, padded}


def test_releasing_again_frees_nothing_and_the_lm_head_still_computes_tokens(stack):
    engine = stack.runtime.engine
    assert stack.ar.call(engine.release_unused_memory()) == 0
    run = stack.ar.call(run_engine(engine, token_prompt(40, 5), max_new_tokens=8))
    assert len(run.finished.generated_token_ids) == 8
