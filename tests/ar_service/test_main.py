"""``python -m ar_service`` in a subprocess: an engine that cannot start makes the process exit; an AR
killed outright takes its vLLM processes with it; one asked to stop exits 0 without a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.support.ports import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_an_engine_that_cannot_start_makes_the_process_exit_non_zero():
    # Too small a KV cache for even one block: vLLM refuses to start the engine.
    env = {**os.environ, "ARDIT_AR_KV_CACHE_BYTES": "4096", "ARDIT_AR_PORT": str(free_port())}
    finished = subprocess.run([sys.executable, "-m", "ar_service"], cwd=REPO, env=env, capture_output=True, timeout=600)
    assert finished.returncode == 3, finished.stderr.decode()[-3000:]
    assert b"AR engine: failed to start" in finished.stderr


def _living(processes: list[psutil.Process]) -> list[psutil.Process]:
    def alive(process: psutil.Process) -> bool:
        try:
            return process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return [process for process in processes if alive(process)]


class _Ar:
    """``python -m ar_service`` with no DiT (the engine starts all the same), its log read as it comes."""

    def __init__(self) -> None:
        env = {**os.environ, "ARDIT_AR_PORT": str(free_port()), "ARDIT_AR_DIT_URL": f"http://127.0.0.1:{free_port()}"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ar_service"], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True
        )
        self.engine_ready = threading.Event()
        self.log: list[str] = []
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()

    def _read_log(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line)
            if "AR engine ready" in line:
                self.engine_ready.set()

    def full_log(self) -> str:
        """Everything it logged, once it has exited."""
        self._reader.join(timeout=30)
        return "".join(self.log)

    def engine_processes(self, timeout: float) -> list[psutil.Process]:
        """Its descendants once vLLM's EngineCore and worker run (named ``VLLM::...``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            descendants = psutil.Process(self.process.pid).children(recursive=True)
            if sum(process.name().startswith("VLLM::") for process in _living(descendants)) >= 2:
                return descendants
            time.sleep(0.2)
        raise AssertionError(f"the engine processes did not start within {timeout} s")


@pytest.mark.parametrize(
    ("sig", "when", "within"),
    [
        (signal.SIGKILL, "ready", 10.0),
        (signal.SIGTERM, "ready", 10.0),
        # Killed before the engine reached ardit's hook, vLLM's processes finish starting, then exit.
        (signal.SIGKILL, "starting", 300.0),
    ],
)
def test_an_ar_that_dies_by_a_signal_leaves_no_vllm_process(sig, when, within):
    ar = _Ar()
    try:
        descendants = ar.engine_processes(timeout=300)
        if when == "ready":
            assert ar.engine_ready.wait(timeout=300)
            descendants = ar.engine_processes(timeout=1)
        ar.process.send_signal(sig)
        ar.process.wait(timeout=60)
        deadline = time.monotonic() + within
        while _living(descendants) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _living(descendants), [process.name() for process in _living(descendants)]
        if sig == signal.SIGTERM:
            # A normal stop: a graceful shutdown, and nothing in the log that looks like a failure. (uvicorn
            # re-raises the SIGTERM it caught once it has shut down, so the status is the signal's.)
            log = ar.full_log()
            assert ar.process.returncode == -signal.SIGTERM and "Application shutdown complete" in log, log[-3000:]
            assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    finally:
        ar.process.kill()
        ar.process.wait()
