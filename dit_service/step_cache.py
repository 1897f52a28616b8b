"""A request's step cache: one of diffusers' cache hooks on the shared transformer for one pipeline call.

diffusers keeps a cache hook's state on the transformer module itself (``CacheMixin.enable_cache``),
keyed by the pipeline's ``cache_context`` ("cond"/"uncond"), not by request. So a hook is enabled
for exactly one pipeline call and removed after it, however the call ends (finished, stopped because
its consumer left, failed): no state outlives its request. Two runs at once on one transformer would
share that state, so a DiT with more than one pipeline run announces no step caches
(``dit_service.capabilities``).

Whether a step was reused is read the same way for every method: the last block's attention either
projected its queries (a full pass) or was skipped or extrapolated by the hook (reused).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from diffusers.hooks.first_block_cache import FirstBlockCacheConfig
from diffusers.hooks.taylorseer_cache import TaylorSeerCacheConfig
from prometheus_client import Counter

from shared.diffusion import FirstBlockCache, StepCache, TaylorSeerCache


def hook_config(cache: StepCache, dtype: torch.dtype) -> FirstBlockCacheConfig | TaylorSeerCacheConfig:
    match cache:
        case FirstBlockCache(threshold=threshold):
            return FirstBlockCacheConfig(threshold=threshold)
        case TaylorSeerCache(interval=interval):
            # Factors in the transformer's own dtype (diffusers defaults to bfloat16): a float32 model's
            # extrapolation is then not rounded to bfloat16.
            return TaylorSeerCacheConfig(cache_interval=interval, taylor_factors_dtype=dtype)


@contextmanager
def step_cache(transformer: Any, cache: StepCache | None, passes: Counter) -> Iterator[None]:
    """Run the block with ``cache``'s hook on ``transformer`` (nothing with None), counting each
    transformer pass as computed or reused in ``passes`` (labels: method, outcome)."""
    if cache is None:
        yield
        return
    computed = [0, 0]  # [transformer passes, of which the last block computed its attention]
    probe = transformer.transformer_blocks[-1].attn.to_q.register_forward_hook(lambda *_: _add(computed, 1))
    count = transformer.register_forward_pre_hook(lambda *_: _add(computed, 0))
    transformer.enable_cache(hook_config(cache, transformer.dtype))
    try:
        yield
    finally:
        transformer.disable_cache()
        probe.remove()
        count.remove()
        total, full = computed
        passes.labels(cache.method, "computed").inc(full)
        passes.labels(cache.method, "reused").inc(total - full)


def _add(counts: list[int], index: int) -> None:
    counts[index] += 1
