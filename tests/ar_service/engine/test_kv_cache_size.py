"""The running engine's KV cache is sized in tokens for its model: the longest request the API admits
and one block for each other sequence scheduled with it, not a fixed byte figure."""

from __future__ import annotations

import math

import pytest

from tests.ar_service.engine.engine_runs import run_engine, token_prompt

pytestmark = pytest.mark.slow


def test_the_engine_holds_the_longest_request_and_one_block_for_each_other_sequence(stack):
    settings, config = stack.settings, stack.runtime.engine.vllm.vllm_config
    assert settings.kv_cache_bytes is None, "the session's AR sizes its KV cache as make run's does"
    block = config.cache_config.block_size
    assert config.model_config.max_model_len == settings.model_len
    longest = math.ceil(settings.model_len / block)
    asked = settings.kv_cache_tokens(block) // block
    assert asked == longest + settings.max_num_seqs - 1
    # vLLM keeps one block back (its null block); the rest is what the settings asked for.
    assert asked - 1 <= config.cache_config.num_gpu_blocks <= asked


def test_the_longest_request_the_api_admits_runs_whole_in_that_cache(stack):
    """At the edge the derived ``max_model_len`` draws: a prompt of ``max_prompt_tokens`` tokens asking for
    ``max_new_tokens_limit`` new ones."""
    settings, engine = stack.settings, stack.runtime.engine
    prompt = token_prompt(settings.max_prompt_tokens, 23)
    run = stack.ar.call(run_engine(engine, prompt, max_new_tokens=settings.max_new_tokens_limit))
    generated = len(run.finished.generated_token_ids)
    assert run.finished.prompt_tokens == settings.max_prompt_tokens
    # Greedy on this prompt, the model never says EOS: a context one token short would end it early.
    assert generated == settings.max_new_tokens_limit
    assert run.finished.row_count == run.rows.shape[0] == settings.max_prompt_tokens + generated - 1
