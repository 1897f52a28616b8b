"""``python -m ar_service`` in a subprocess: an engine that cannot start makes the process exit; an AR
killed outright takes its vLLM processes with it; one asked to stop (SIGTERM) drains and exits 0 without a
traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import psutil
import pytest

from services.fatal import EXIT_SETTINGS
from tests.conftest import PLUMBING_DIT_MODEL_DIR, require_checkpoint
from tests.support.ports import free_port
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_an_engine_that_cannot_start_makes_the_process_exit_non_zero():
    # Too small a KV cache for even one block: vLLM refuses to start the engine.
    env = {**os.environ, "ARDIT_AR_KV_CACHE_BYTES": "4096", "ARDIT_AR_PORT": str(free_port())}
    finished = subprocess.run([sys.executable, "-m", "ar_service"], cwd=REPO, env=env, capture_output=True, timeout=600)
    assert finished.returncode == 3, finished.stderr.decode()[-3000:]
    assert b"AR engine: failed to start" in finished.stderr


def test_a_model_folder_that_cannot_serve_stops_the_process_with_one_line_that_names_what_is_missing():
    folder = require_checkpoint(PLUMBING_DIT_MODEL_DIR)  # a DiT-only pipeline folder: no text encoder
    env = {**os.environ, "ARDIT_AR_MODEL_DIR": str(folder), "ARDIT_AR_PORT": str(free_port())}
    finished = subprocess.run([sys.executable, "-m", "ar_service"], cwd=REPO, env=env, capture_output=True, timeout=600)
    assert finished.returncode == EXIT_SETTINGS
    assert finished.stderr.decode().splitlines()[-1] == (
        f"ardit AR service: {folder} is a QwenImagePipeline folder without its text_encoder/: the AR serves the "
        "text encoder (point ARDIT_AR_MODEL_DIR at a folder that ships it)"
    )
    assert b"Traceback" not in finished.stderr


def _living(processes: list[psutil.Process]) -> list[psutil.Process]:
    def alive(process: psutil.Process) -> bool:
        try:
            return process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return [process for process in processes if alive(process)]


class _Ar:
    """``python -m ar_service`` with no DiT (the engine starts all the same), its log read as it comes."""

    def __init__(self, **environment: str) -> None:
        self.port = free_port()
        env = {
            **os.environ,
            "ARDIT_AR_PORT": str(self.port),
            "ARDIT_AR_DIT_URL": f"http://127.0.0.1:{free_port()}",
            **environment,
        }
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
        """Its descendants once vLLM's EngineCore runs (``VLLM::EngineCore``; on CPU it runs the model too)."""
        descendants: list[psutil.Process] = []

        def engine_running() -> bool:
            descendants[:] = psutil.Process(self.process.pid).children(recursive=True)
            return any(process.name().startswith("VLLM::") for process in _living(descendants))

        wait_for(engine_running, timeout, "the engine processes start", every=0.2)
        return descendants


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
        wait_for(
            lambda: not _living(descendants),
            within,
            "every vLLM process exits",
            every=0.2,
            state=lambda: [process.name() for process in _living(descendants)],
        )
        if sig == signal.SIGTERM:
            # A normal stop: drained (nothing was in flight), shut down gracefully, exit status 0, and
            # nothing in the log that looks like a failure.
            log = ar.full_log()
            assert ar.process.returncode == 0 and "drained after" in log, log[-3000:]
            assert "Application shutdown complete" in log, log[-3000:]
            assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    finally:
        ar.process.kill()
        ar.process.wait()


def test_the_internal_port_serves_the_render_call_and_probes_without_a_key_and_nothing_else():
    internal = free_port()
    ar = _Ar(ARDIT_AR_API_KEYS='["sk-main"]', ARDIT_AR_INTERNAL_PORT=str(internal))
    try:
        assert ar.engine_ready.wait(timeout=300)
        public, inside = f"http://127.0.0.1:{ar.port}", f"http://127.0.0.1:{internal}"
        render = {"prompt": "a red square"}
        assert httpx.post(f"{public}/v1/completions/render", json=render).status_code == 401
        rendered = httpx.post(f"{inside}/v1/completions/render", json=render)
        assert rendered.status_code == 200 and rendered.json()[0]["token_ids"]
        for probe in ("/health", "/healthz", "/metrics"):
            assert httpx.get(f"{inside}{probe}").status_code == 200
        for probe in ("/health", "/healthz"):
            assert httpx.get(f"{public}{probe}").status_code == 200  # open on the public port too
        # With keys on, the public /metrics is the operator's; this AR has no admin token, so it is the internal port's.
        tenant = httpx.get(f"{public}/metrics", headers={"authorization": "Bearer sk-main"})
        assert tenant.status_code == 401 and tenant.json()["error"]["code"] == "invalid_admin_token"
        generation = httpx.post(f"{inside}/v1/images/generations", json=render)
        assert generation.status_code == 404 and generation.json()["error"]["code"] == "not_found"
        assert httpx.get(f"{inside}/v1/models").status_code == 404
    finally:
        ar.process.send_signal(signal.SIGTERM)
        ar.process.wait(timeout=60)


def test_a_stream_still_rendering_when_the_drain_period_ends_gets_an_error_event_and_the_ar_exits_0():
    dit_port = free_port()
    dit_env = {
        **os.environ,
        "ARDIT_DIT_MODEL_DIR": str(require_checkpoint(PLUMBING_DIT_MODEL_DIR)),
        "ARDIT_DIT_PORT": str(dit_port),
        "ARDIT_HANDOFF_TOKEN": "drain-test",
    }
    dit = subprocess.Popen([sys.executable, "-m", "dit_service"], cwd=REPO, env=dit_env, stderr=subprocess.DEVNULL)
    ar = _Ar(
        ARDIT_AR_DIT_URL=f"http://127.0.0.1:{dit_port}", ARDIT_HANDOFF_TOKEN="drain-test", ARDIT_AR_DRAIN_SECONDS="1"
    )
    try:
        url = f"http://127.0.0.1:{ar.port}"
        assert ar.engine_ready.wait(timeout=300)
        wait_for(
            lambda: httpx.get(f"{url}/readyz").status_code == 200, 120, "the pair (the DiT too) is ready", every=0.5
        )
        # A render of many seconds (the largest size, many steps), stopped by SIGTERM once it streams.
        body = {"prompt": "a long render", "size": "1024x1024", "num_inference_steps": 60, "stream": True}
        events: list[str] = []
        error: dict[str, str] = {}
        with httpx.stream("POST", f"{url}/v1/images/generations", json=body, timeout=120) as answer:
            assert answer.status_code == 200
            ar.process.send_signal(signal.SIGTERM)
            for line in answer.iter_lines():
                if line.startswith("event:"):
                    events.append(line.split(":", 1)[1].strip())
                if line.startswith("data:") and events[-1:] == ["error"]:
                    error = json.loads(line.split(":", 1)[1])["error"]
        assert events[-1] == "error" and error["code"] == "shutting_down", events
        assert ar.process.wait(timeout=60) == 0
    finally:
        ar.process.kill()
        ar.process.wait()
        dit.terminate()
        dit.wait(timeout=30)
