"""Engines started side by side for a benchmark: the same settings but the ones it compares, every core each.

Import after ``paired.use_this_checkout()``.
"""

from __future__ import annotations

from typing import Any

import psutil
import torch

from ar_service import ArSettings, HiddenStateEngine

# Room for a 5.6k-token prompt and its cached blocks; prefix caching on, as the service runs it.
COMMON_SETTINGS: dict[str, Any] = {
    "enable_prefix_caching": True,
    "kv_cache_bytes": 512 << 20,
    "max_model_len": 8192,
    "max_num_batched_tokens": 2048,
}


def workload(length: int, seed: int) -> list[int]:
    """``length`` token ids, the same for a seed: a prompt no template or cache has seen."""
    return torch.randint(100, 40000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def start_engine(name: str, overrides: dict[str, Any]) -> tuple[HiddenStateEngine, psutil.Process]:
    """A started engine with ``COMMON_SETTINGS`` plus ``overrides``, and its EngineCore process."""
    me = psutil.Process()
    before = {p.pid for p in me.children()}
    engine = HiddenStateEngine(ArSettings(**COMMON_SETTINGS, **overrides))
    engine.start()
    new = [p for p in me.children() if p.pid not in before and "EngineCore" in " ".join([*p.cmdline(), p.name()])]
    if len(new) != 1:
        raise RuntimeError(f"{name}: cannot tell its EngineCore process ({new})")
    return engine, new[0]
