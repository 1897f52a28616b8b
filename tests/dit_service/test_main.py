"""``python -m dit_service`` in a subprocess, configured only through the environment."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.dit_service.handoff_requests import AR_MODEL, complete_handoff, handoff_headers, hidden_rows, post_handoff
from tests.support.ports import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_module_entrypoint_serves_handoffs(tiny_checkpoint):
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "ARDIT_DIT_MODEL_DIR": str(tiny_checkpoint),
        "ARDIT_DIT_PORT": str(port),
        "ARDIT_DIT_TORCH_THREADS": "1",
        "ARDIT_DIT_EXPECTED_MODEL": AR_MODEL,
        "ARDIT_HANDOFF_TOKEN": "from-env",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "dit_service"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read().decode()
            try:
                if httpx.get(f"{url}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "not ready in time"
            time.sleep(0.2)
        answer = post_handoff(url, complete_handoff(hidden_rows(6)), headers=handoff_headers("from-env"))
        assert answer.status == 200 and answer.kinds == ["image", "done"]
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_model_that_cannot_load_makes_the_process_exit_non_zero(tmp_path):
    env = {
        **os.environ,
        "ARDIT_DIT_MODEL_DIR": str(tmp_path / "missing"),
        "ARDIT_DIT_PORT": str(free_port()),
        "ARDIT_HANDOFF_TOKEN": "t",
    }
    started = time.monotonic()
    finished = subprocess.run(
        [sys.executable, "-m", "dit_service"], cwd=REPO, env=env, capture_output=True, timeout=120
    )
    assert finished.returncode == 3, finished.stderr.decode()[-2000:]
    assert b"model load failed" in finished.stderr and time.monotonic() - started < 120
