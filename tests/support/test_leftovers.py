"""The end-of-run check finds what a run left running, names it and kills it."""

from __future__ import annotations

import subprocess
import uuid

from tests.support import leftovers


def _run_marked(monkeypatch) -> None:
    # A run of its own, so the check sees only this test's processes, not the session's engine.
    monkeypatch.setenv(leftovers.MARKER, uuid.uuid4().hex)


def test_a_process_left_running_is_named_and_killed(monkeypatch):
    _run_marked(monkeypatch)
    orphan = subprocess.Popen(["sleep", "300"])
    left = leftovers.reap(grace_seconds=0.5)
    assert len(left) == 1 and "sleep 300" in left[0]
    assert orphan.wait(timeout=5) < 0


def test_a_process_that_ends_within_the_grace_time_is_not_a_leftover(monkeypatch):
    _run_marked(monkeypatch)
    subprocess.Popen(["sleep", "0.5"])
    assert leftovers.reap(grace_seconds=5) == []
