"""The startup heap marked static, and the memory start-up freed given back to the system.

A service imports torch, transformers and diffusers (and the AR, vLLM): millions of objects that
live as long as the process. Python's oldest-generation collection walks all of them every few hundred
requests with the event loop stopped, and a burst's refusals all wait behind it
(``benchmarks/results/door_burst.md``). ``gc.freeze`` moves what exists once the service is ready into a
generation the collector ignores — what vLLM's own API server does after start-up
(``vllm.utils.gc_utils``); objects made later are collected as before.

Loading a model frees much of what it allocated (checkpoint reads, weights replaced by packed
copies), and glibc's malloc keeps freed memory inside its heap for reuse: only what is free at the
heap's top goes back on its own. ``malloc_trim`` gives back every free page, wherever it is (how much:
``benchmarks/results/memory_table.md``). When it happens matters as much: the service's peak RSS is the sum
over its processes at one moment, and the AR's engine core starts while the API process still holds what its
own start-up freed.

Serving frees much too: every step's activations. glibc raises its mmap threshold to the size of each
large block freed (up to 32 MB), so blocks of a few MB come from the heap after the first and stay
there, scattered. ``IdleRelease`` gives them back once a service has had nothing to do for a second.
Not after every request: the next one would fault its pages in again (a fixed mmap threshold, which
maps and unmaps every such block each time, served fewer images a minute;
``benchmarks/results/memory_table.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable

# How long a service has nothing in flight before it gives its free pages back (``IdleRelease``).
RELEASE_IDLE_SECONDS = 1.0
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")

log = logging.getLogger("ardit.heap")


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


def return_free_pages() -> int:
    """glibc's ``malloc_trim(0)``: every whole free page of malloc's heaps back to the system (a C library
    without it keeps them). The bytes of resident memory that went back (approximate: other threads
    allocate and free meanwhile)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "malloc_trim"):
        return 0
    before = _resident_bytes()
    libc.malloc_trim(0)
    return max(0, before - _resident_bytes())


async def return_free_pages_in_thread() -> int:
    """``return_free_pages`` off the event loop: trimming a heap of a few hundred MB takes milliseconds."""
    return await asyncio.to_thread(return_free_pages)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE_SIZE


class IdleRelease:
    """Runs ``release`` once nothing has been ``in_flight`` for ``delay`` seconds (never if ``delay`` is
    0): once per idle spell. Work that starts during the wait cancels it; a release already under
    way finishes (it is quick, and cancelling the AR's call into its engine core would strand it).
    The owner's ``release`` gives back free pages (the DiT its own, the AR its engine core's) and says how
    many bytes went back."""

    def __init__(self, delay: float, release: Callable[[], Awaitable[int]]) -> None:
        self.delay = delay
        self.releases = 0
        self.returned_bytes = 0
        self._release = release
        self._in_flight = 0
        self._waiting: asyncio.Task[None] | None = None  # sleeping out the delay: work that starts cancels it
        self._tasks: set[asyncio.Task[None]] = set()  # strong references: the loop keeps only weak ones

    @contextlib.asynccontextmanager
    async def in_flight(self) -> AsyncIterator[None]:
        self._in_flight += 1
        if self._waiting is not None:
            self._waiting.cancel()
            self._waiting = None
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0 and self.delay > 0:
                self._waiting = asyncio.create_task(self._release_after(self.delay), name="idle-release")
                self._tasks.add(self._waiting)
                self._waiting.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        if self._waiting is not None:
            self._waiting.cancel()
            self._waiting = None
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _release_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        self._waiting = None
        try:
            returned = await self._release()
        except Exception:  # a process that cannot give pages back keeps them; serving goes on
            log.warning("giving free pages back failed", exc_info=True)
            return
        self.releases += 1
        self.returned_bytes += returned
        log.debug("idle: %.1f MiB of free memory back to the system", returned / 2**20)
