"""A CPU engine's worker waits for its next step asleep, not spinning on a core.

vLLM 0.32 runs a CPU model in a worker process fed by a shared-memory queue
(``shm_broadcast.MessageQueue``). For one second after every read the worker polls that queue with
``sched_yield`` in a tight loop (``SpinCondition.busy_loop_s``); only then does it wait on the
queue's notification socket. On a GPU host that second costs a spare core. On a CPU host it costs a
core the DiT needs. Measured on the 2-core machine with the demo model at ``make run``'s defaults: a
request whose AR part takes 75 ms has the worker burn 1.1-1.2 s of CPU, and the DiT's two-thread
denoise takes 1.15 s where one thread alone takes 0.3 s (each of its barriers waits for a thread that
has no core).

The poll stays, asleep: within the second after a read the worker checks the queue every
``POLL_SECONDS``. Dropping the second altogether is not safe: the queue's notifications are lossy
(a publisher with a high-water mark of one drops a notification sent right after another), and a
reader that waits only on them missed steps and waited ``SHM_READER_RECHECK_INTERVAL_MS`` (5 s) for
each (measured: 9 of 20 requests took 5.3 s).

vLLM imports ``worker_extension_cls`` in the worker process before the worker opens its queues, so
naming :class:`SleepingWorker` there is the hook: importing this module installs the wait. The engine
names it when ``ARDIT_AR_CPU_WORKER_BUSY_POLL`` is false; by default vLLM's busy poll stays, since the
faster pace this gives grows the bursts the AR must refuse at once past what it refuses within its
bound (benchmarks/results/README.md, issue 26).
"""

from __future__ import annotations

import functools
import time

import vllm
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

CHECKED_VLLM = "0.32.0"
# Up to this much later a step starts (CPU engine steps take tens of milliseconds); about 2,000
# wake-ups a second while the engine is busy, a few percent of one core.
POLL_SECONDS = 0.0005
_WRAPPED = "_ardit_sleeping_poll"


def install() -> None:
    """Make every ``SpinCondition`` reader in this process sleep between its polls (idempotent)."""
    if vllm.__version__ != CHECKED_VLLM:
        raise RuntimeError(
            f"the worker's sleeping wait was checked against vLLM {CHECKED_VLLM}, this is {vllm.__version__}: "
            "check shm_broadcast.SpinCondition.wait still spins with sched_yield until last_read + busy_loop_s"
        )
    if installed():
        return
    wait = SpinCondition.wait

    @functools.wraps(wait)
    def wait_asleep(self: SpinCondition, timeout_ms: int | None = None) -> None:
        if time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(POLL_SECONDS)
        else:
            wait(self, timeout_ms)

    setattr(wait_asleep, _WRAPPED, True)
    SpinCondition.wait = wait_asleep  # type: ignore[method-assign]


def installed() -> bool:
    """Whether this process's queue readers sleep between polls (the wrap is not undone)."""
    return bool(getattr(SpinCondition.wait, _WRAPPED, False))


class SleepingWorker:
    """The ``worker_extension_cls`` whose import installs the sleeping wait; it adds nothing to the worker."""


install()
