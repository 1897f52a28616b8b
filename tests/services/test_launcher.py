"""The launcher's supervision: restarts with backoff, and gives up loudly on a crash loop."""

from __future__ import annotations

import os

import pytest

from services import launcher
from services.launcher import MAX_CRASHES, Service, supervise
from tests.support.ports import free_port


def test_restarts_back_off_and_a_crash_loop_is_given_up():
    service = Service("dit", "dit_service", {})
    delays = []
    for _ in range(MAX_CRASHES - 1):
        assert service.crashed(now=100.0)
        assert service.restart_at is not None
        delays.append(service.restart_at - 100.0)
    assert delays == sorted(delays) and delays[0] == 1.0
    assert not service.crashed(now=100.0)


def test_crashes_long_ago_are_forgiven():
    service = Service("dit", "dit_service", {})
    for minute in range(MAX_CRASHES * 2):
        assert service.crashed(now=minute * 60.0)  # one crash a minute never adds up to a loop


@pytest.mark.slow
def test_a_service_that_keeps_crashing_makes_the_launcher_give_up(monkeypatch, capsys):
    monkeypatch.setattr(launcher, "BACKOFF_SECONDS", (0.1, 0.2))
    doomed = Service("doomed", "ardit_no_such_module", dict(os.environ))
    doomed.start()
    assert supervise([doomed], f"http://127.0.0.1:{free_port()}", ready_timeout=120) == 1
    assert f"doomed crashed {MAX_CRASHES} times" in capsys.readouterr().err


def test_the_services_openmp_threads_spin_briefly_unless_the_operator_says_otherwise(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert launcher.service_environment()["GOMP_SPINCOUNT"] == str(launcher.OPENMP_SPIN_ROUNDS)
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    assert launcher.service_environment()["GOMP_SPINCOUNT"] == "300000"
