"""The VAE every request's pipeline shares, with what decoding outside a pipeline reads of it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch


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

    def encoding_under_lock(self) -> EncodesUnderLock:
        """The VAE as a pipeline that encodes pictures inside its own ``__call__`` (a reference edit's) is given it."""
        return EncodesUnderLock(self.module, self.lock)


class EncodesUnderLock(torch.nn.Module):
    """The shared VAE, its ``encode`` taken under the shared lock; every other attribute is the VAE's own.

    A reference edit's pipeline VAE-encodes its pictures itself, mid-``__call__``, with ``self.vae.encode``, while other
    renders decode on the same module: it is given this in front of the VAE as its ``vae`` component (diffusers'
    public constructor), so that its encodes wait for theirs. The pipeline reads the VAE's config, dtype, device and
    ``temperal_downsample`` through it too."""

    def __init__(self, vae: torch.nn.Module, lock: threading.Lock) -> None:
        super().__init__()
        self.vae: Any = vae  # registered as a submodule: the pipeline finds the device and dtype through it
        self._lock = lock

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self.vae.encode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["vae"], name)
