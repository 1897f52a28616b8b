"""The startup heap marked static, so the garbage collector stops walking it on every full collection.

A service imports torch, transformers and diffusers (and the AR, vLLM): millions of objects that
live as long as the process. Python's oldest-generation collection walks all of them, and here it
did so every few hundred requests for 0.37-0.53 s with the event loop stopped: a burst's refusals
all waited behind it (every 429 of a 783-request burst came after 450-590 ms; the door itself
takes 0.1 ms). ``gc.freeze`` moves what exists once the service is ready into a generation the
collector ignores — what vLLM's own API server does after start-up (``vllm.utils.gc_utils``);
objects made later are collected as before.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Call once, when the service is ready and before it takes requests: collects what start-up left
    behind (so it is not frozen as garbage), then freezes the rest."""
    gc.collect()
    gc.freeze()
