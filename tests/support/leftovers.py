"""Processes a test run started that are still running at its end.

Every process the run starts inherits ``ARDIT_TEST_RUN`` (set once, at configure) in its
environment, so a leftover is found however it was started (a fixture, a service's engine, a
launcher's child) and whoever its parent is now (an orphan's is init).
"""

from __future__ import annotations

import os
import uuid
from multiprocessing import resource_tracker

import psutil

from tests.support.waiting import holds_within

MARKER = "ARDIT_TEST_RUN"


def mark_this_run() -> None:
    os.environ[MARKER] = uuid.uuid4().hex


def leftovers() -> list[psutil.Process]:
    """Living processes of this run other than the test process itself and its multiprocessing resource
    tracker (which lives as long as the test process, by design)."""
    run = os.environ.get(MARKER)
    if run is None:
        return []
    own = {os.getpid(), getattr(resource_tracker._resource_tracker, "_pid", None)}
    found = []
    for process in psutil.process_iter(["pid", "status"]):
        if process.pid in own or process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if process.environ().get(MARKER) == run:
                found.append(process)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def reap(grace_seconds: float) -> list[str]:
    """Wait ``grace_seconds`` for the run's processes to end, kill those that do not; describe them."""
    found: list[psutil.Process] = []

    def none_left() -> bool:
        found[:] = leftovers()
        return not found

    holds_within(none_left, grace_seconds, every=0.5)  # each look lists every process: not too often
    described = []
    for process in found:
        try:
            described.append(f"pid {process.pid} {' '.join(process.cmdline())[:200]}")
            process.kill()
        except psutil.NoSuchProcess:
            continue
    return described
