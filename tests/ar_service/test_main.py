"""``python -m ar_service`` in a subprocess: an engine that cannot start makes the process exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
