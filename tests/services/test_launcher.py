"""The launcher's supervision: restarts with backoff, and gives up loudly on a crash loop."""

from __future__ import annotations

import os
from collections import deque

import pytest

from services import launcher
from services.fatal import EXIT_SETTINGS
from services.launcher import MAX_CRASHES, Service, supervise
from tests.conftest import PLUMBING_DIT_MODEL_DIR, require_checkpoint
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


@pytest.mark.slow
def test_a_service_that_exits_0_stopped_as_asked_and_is_started_again_without_counting_a_crash(capsys):
    stopped = Service("site", "site", dict(os.environ))  # `python -m site` prints and exits 0
    stopped.start()
    assert supervise([stopped], f"http://127.0.0.1:{free_port()}", ready_timeout=3) == 1  # never ready: a guard
    assert stopped.crashes == deque()
    assert "site stopped (it was asked to); starting it again" in capsys.readouterr().err


@pytest.mark.slow
def test_a_service_that_cannot_start_with_its_settings_is_not_restarted(tmp_path, capsys):
    env = {**os.environ, "ARDIT_AR_MODEL_DIR": str(tmp_path / "absent"), "ARDIT_AR_PORT": str(free_port())}
    ar = Service("ar", "ar_service", env)
    ar.start()
    assert supervise([ar], f"http://127.0.0.1:{free_port()}", ready_timeout=120) == 1
    assert ar.crashes == deque() and ar.exited() == EXIT_SETTINGS
    err = capsys.readouterr().err
    assert "ar cannot start with these settings" in err and "restarting it in" not in err


def test_the_services_openmp_threads_spin_briefly_unless_the_operator_says_otherwise(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert launcher.service_environment()["GOMP_SPINCOUNT"] == str(launcher.OPENMP_SPIN_ROUNDS)
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    assert launcher.service_environment()["GOMP_SPINCOUNT"] == "300000"


def test_a_dit_given_a_folder_with_its_text_encoder_gives_the_ar_that_folder_unless_the_ar_has_one(monkeypatch):
    from services.checkpoints import Z_IMAGE_MODEL, default_model_dir

    family = str(require_checkpoint(default_model_dir(Z_IMAGE_MODEL)))
    monkeypatch.delenv("ARDIT_AR_MODEL_DIR", raising=False)
    monkeypatch.setenv("ARDIT_DIT_MODEL_DIR", family)
    assert launcher.service_environment()["ARDIT_AR_MODEL_DIR"] == family
    monkeypatch.setenv("ARDIT_AR_MODEL_DIR", "/srv/models/own")
    assert launcher.service_environment()["ARDIT_AR_MODEL_DIR"] == "/srv/models/own"
    monkeypatch.delenv("ARDIT_AR_MODEL_DIR")
    monkeypatch.setenv("ARDIT_DIT_MODEL_DIR", str(require_checkpoint(PLUMBING_DIT_MODEL_DIR)))  # no text encoder
    assert "ARDIT_AR_MODEL_DIR" not in launcher.service_environment()
