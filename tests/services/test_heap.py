"""services/heap.py: memory freed inside malloc's heap goes back to the system when asked and once a service
has been idle, and a ready service's start-up objects are frozen out of the collector's walks."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import textwrap

from services.heap import IdleRelease, freeze_startup_heap
from tests.support.waiting import until

# 200 MB in 64 KB pieces (below malloc's mmap threshold: they live in its heap), all freed but the
# last, which keeps the heap's top in use so glibc cannot give the rest back on its own.
FREED_INSIDE_THE_HEAP = textwrap.dedent(
    """
    from services.heap import return_free_pages

    def rss_mb():
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) // 1024

    pieces = [b"x" * (64 << 10) for _ in range(3200)]
    top = pieces[-1]
    del pieces
    before = rss_mb()
    returned = return_free_pages()
    print(before, rss_mb(), returned >> 20)
    """
)


def test_pages_freed_inside_the_heap_go_back_to_the_system_and_their_bytes_are_told():
    answer = subprocess.run([sys.executable, "-c", FREED_INSIDE_THE_HEAP], capture_output=True, text=True, check=True)
    before, after, returned = map(int, answer.stdout.split())
    assert before - after > 150, (before, after)
    assert abs(returned - (before - after)) <= 2, (returned, before, after)


def test_freezing_leaves_start_up_objects_out_of_the_collectors_walks():
    gc.unfreeze()
    kept = [object() for _ in range(1000)]
    freeze_startup_heap()
    try:
        assert gc.get_freeze_count() >= len(kept)
    finally:
        gc.unfreeze()


def released_after(delay: float, scenario) -> list[float]:
    """The times (from the start) at which an ``IdleRelease`` of ``delay`` seconds released during ``scenario``."""
    releases: list[float] = []

    async def run() -> None:
        started = asyncio.get_running_loop().time()

        async def release() -> int:
            releases.append(asyncio.get_running_loop().time() - started)
            return 0

        idle = IdleRelease(delay, release)
        await scenario(idle)
        await idle.aclose()

    asyncio.run(run())
    return releases


def test_a_service_gives_its_free_pages_back_once_it_has_been_idle_for_the_delay():
    async def one_request_then_quiet(idle: IdleRelease) -> None:
        async with idle.in_flight():
            await asyncio.sleep(0.05)
        await until(lambda: idle.releases == 1, what="the release")

    (at,) = released_after(0.1, one_request_then_quiet)  # once, during the quiet that followed
    assert at >= 0.15  # not before the delay had passed since the request ended


def test_work_that_starts_during_the_wait_puts_the_release_off_until_it_is_idle_again():
    async def a_request_every_50_ms(idle: IdleRelease) -> None:
        for _ in range(6):
            async with idle.in_flight():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.04)
        await until(lambda: idle.releases == 1, what="the release")

    (at,) = released_after(0.1, a_request_every_50_ms)
    assert at >= 0.35


def test_nothing_is_released_while_work_overlaps_and_once_per_idle_spell():
    async def overlapping_then_quiet(idle: IdleRelease) -> None:
        async def request(seconds: float) -> None:
            async with idle.in_flight():
                await asyncio.sleep(seconds)

        await asyncio.gather(request(0.05), request(0.3))
        await until(lambda: idle.releases == 1, what="the release")
        await asyncio.sleep(0.3)  # three more delays of quiet, in which a second release would come

    (at,) = released_after(0.1, overlapping_then_quiet)
    assert at >= 0.4


def test_a_delay_of_zero_never_releases():
    async def one_request_then_quiet(idle: IdleRelease) -> None:
        async with idle.in_flight():
            pass
        await asyncio.sleep(0.1)

    assert released_after(0, one_request_then_quiet) == []


def test_a_release_that_fails_is_logged_and_serving_goes_on(caplog):
    async def run() -> None:
        async def release() -> int:
            raise OSError("no")

        idle = IdleRelease(0.01, release)
        async with idle.in_flight():
            pass
        await until(lambda: "giving free pages back failed" in caplog.text, what="the failed release logged")
        async with idle.in_flight():
            pass
        await idle.aclose()

    asyncio.run(run())
    assert "giving free pages back failed" in caplog.text


def test_closing_cancels_a_release_still_waiting():
    async def one_request(idle: IdleRelease) -> None:
        async with idle.in_flight():
            pass

    assert released_after(0.05, one_request) == []
