"""Reusable host memory for received rows.

A fresh buffer costs several times its own copy in first-touch page faults
(benchmarks/results/handoff_codec.md); a receiver that handles handoffs back to back keeps a few
released buffers warm instead. Idle memory is bounded by ``max_idle_bytes``.
"""

from __future__ import annotations

import threading

import torch


class RowBufferPool:
    def __init__(self, max_idle_bytes: int) -> None:
        self._max_idle = max_idle_bytes
        self._idle: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.in_use_bytes = 0

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._idle)

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of at least ``nbytes``: the smallest idle one that fits, else new."""
        with self._lock:
            fits = [i for i, b in enumerate(self._idle) if b.numel() >= nbytes]
            buf = self._idle.pop(min(fits, key=lambda i: self._idle[i].numel())) if fits else None
            self.in_use_bytes += buf.numel() if buf is not None else nbytes
        return buf if buf is not None else torch.empty(nbytes, dtype=torch.uint8)

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self.in_use_bytes -= buf.numel()
            self._idle.append(buf)
            # Keep the largest buffers (they serve any smaller request) within the idle bound.
            self._idle.sort(key=torch.Tensor.numel, reverse=True)
            while self._idle and sum(b.numel() for b in self._idle) > self._max_idle:
                self._idle.pop()
