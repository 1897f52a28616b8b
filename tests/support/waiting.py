"""Waiting for what the other side does: look at a condition until it holds.

A test that means "once the server has accepted them" waits for exactly that, not for a fixed time that is
usually long enough: on a busy machine a fixed sleep ends too early (a flaky test), on an idle one it wastes
the rest. The timeout is a guard against a hang, generous on purpose; it is not what the test checks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

HANG_GUARD = 60.0  # seconds: far past anything waited on here; only a hang reaches it
# Between two looks: short against what is waited on, long against a look (a dict read or a local request).
EVERY = 0.02


def holds_within(condition: Callable[[], object], timeout: float, *, every: float = EVERY) -> bool:
    """Whether ``condition``, looked at every ``every`` seconds, comes true within ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


def wait_for(
    condition: Callable[[], object],
    timeout: float = HANG_GUARD,
    what: str = "the condition",
    *,
    every: float = EVERY,
    state: Callable[[], object] | None = None,
) -> float:
    """Look at ``condition`` every ``every`` seconds until it is true; fail naming ``what`` (and ``state()``,
    what to see of the failure) after ``timeout``. Returns the seconds waited."""
    started = time.monotonic()
    if not holds_within(condition, timeout, every=every):
        seen = "" if state is None else f" ({state()})"
        raise AssertionError(f"{what}: not within {timeout:g} s{seen}")
    return time.monotonic() - started


async def until(
    condition: Callable[[], object], timeout: float = HANG_GUARD, what: str = "the condition", *, every: float = EVERY
) -> float:
    """``wait_for`` on an event loop: the loop keeps running what the condition waits on."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not condition():
        if loop.time() - started > timeout:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        await asyncio.sleep(every)
    return loop.time() - started


async def within(awaitable: Awaitable[T], what: str, timeout: float = HANG_GUARD) -> T:
    """Await ``awaitable`` (an ``Event.wait()``, a task), failing naming ``what`` if it hangs."""
    try:
        return await asyncio.wait_for(awaitable, timeout)
    except TimeoutError:
        raise AssertionError(f"{what}: not within {timeout:g} s") from None
