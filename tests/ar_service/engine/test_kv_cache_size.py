"""The running engine's KV cache is sized in tokens for its model: the longest request the API admits
and one block for each other sequence scheduled with it, not a fixed byte figure."""

from __future__ import annotations

import math

import pytest

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
