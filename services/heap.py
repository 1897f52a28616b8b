"""The startup heap marked static, and the memory start-up freed given back to the system.

A service imports torch, transformers and diffusers (and the AR, vLLM): millions of objects that
live as long as the process. Python's oldest-generation collection walks all of them, and here it
did so every few hundred requests for 0.37-0.53 s with the event loop stopped: a burst's refusals
all waited behind it (every 429 of a 783-request burst came after 450-590 ms; the door itself
takes 0.1 ms). ``gc.freeze`` moves what exists once the service is ready into a generation the
collector ignores — what vLLM's own API server does after start-up (``vllm.utils.gc_utils``);
objects made later are collected as before.

Loading a model frees much of what it allocated (checkpoint reads, weights replaced by packed
copies), and glibc's malloc keeps freed memory inside its heap for reuse: only what is free at the
heap's top goes back on its own. ``malloc_trim`` gives back every free page, wherever it is: 70 MB of
the AR's engine core and 49 MB of its API process at the defaults (``benchmarks/results/memory_table.json``).
When it happens matters as much: the service's peak RSS is the sum over its processes at one moment, and
the AR's engine core starts while the API process still holds what its own start-up freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc


def freeze_startup_heap() -> None:
    """Call once, when the service is ready and before it takes requests: collects what start-up left
    behind (so it is not frozen as garbage), freezes the rest, and gives the freed pages back."""
    gc.collect()
    gc.freeze()
    return_free_pages()


def collect_free_pages() -> None:
    """Collects garbage and gives the freed pages back: before a step of start-up that allocates much."""
    gc.collect()
    return_free_pages()


def return_free_pages() -> None:
    """glibc's ``malloc_trim(0)``: every whole free page of malloc's heaps back to the system (a C library
    without it keeps them)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
