"""Processes that do not outlive their parent (Linux's parent-death signal).

A service started by the launcher, and the vLLM engine processes started by the AR, each ask the
kernel for a signal when the process that started them dies, however it dies (SIGKILL included,
where no handler of the parent's runs). The signal is delivered when the *thread* that started the
child exits, so a child must be started from a thread that lives as long as the parent wants it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals, parent_pid: int | None = None) -> None:
    """In the calling process: receive ``sig`` when the parent dies. With ``parent_pid``, a parent that
    died before this call (the process was reparented) sends it now. A no-op off Linux."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
