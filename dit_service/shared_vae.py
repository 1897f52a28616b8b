"""The VAE every request's pipeline shares, with what decoding outside a pipeline reads of it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SharedVae:
    # The loaded diffusers VAE (``Any``: diffusers registers a pipeline's components at run time).
    module: Any
    # Pixels per latent along each side (the pipeline's ``vae_scale_factor``).
    scale_factor: int
    # AutoencoderKLQwenImage keeps its causal-conv feature cache on the module itself (clear_cache/_feat_map), so two
    # encodes or decodes at once on the shared VAE corrupt each other: every use outside a pipeline that touches that
    # cache takes this lock.
    lock: threading.Lock = field(default_factory=threading.Lock)
