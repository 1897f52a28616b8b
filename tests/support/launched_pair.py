"""The pair as `make run` starts it: ``python -m services.launcher`` in a subprocess, at its defaults.

Only the ports (free loopback ones) and, where a test says so, the DiT's model directory and the
settings it names change.
The services run in processes of their own, as users get them (no test code shares their GIL).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from tests.support import waiting
from tests.support.ports import free_port

READY_TIMEOUT = 600.0


@dataclass
class Pair:
    launcher: subprocess.Popen[bytes]
    ar_url: str
    dit_url: str
    log: Path

    def service(self, module: str) -> psutil.Process:
        for child in psutil.Process(self.launcher.pid).children():
            if f"-m{module}" in "".join(child.cmdline()):
                return child
        raise LookupError(f"{module} is not running")

    def generate(self, timeout: float = 120.0, **body) -> httpx.Response:
        payload = {"prompt": "a blue circle", "size": "64x64", "num_inference_steps": 2, **body}
        return httpx.post(f"{self.ar_url}/v1/images/generations", json=payload, timeout=timeout)


def wait_for(condition, timeout: float, what: str) -> float:
    """tests/support/waiting.py's, looking every 0.1 s: a look here is a request to a service of the pair,
    which shares the machine's cores with the test."""
    return waiting.wait_for(condition, timeout, what, every=0.1)


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@contextmanager
def launched_pair(
    log: Path, dit_model_dir: Path | None = None, settings: dict[str, str] | None = None
) -> Iterator[Pair]:
    ar_port, dit_port = free_port(), free_port()
    env = dict(os.environ, **(settings or {}), ARDIT_AR_PORT=str(ar_port), ARDIT_DIT_PORT=str(dit_port))
    if dit_model_dir is not None:
        env["ARDIT_DIT_MODEL_DIR"] = str(dit_model_dir)
    with log.open("wb") as out:
        launcher = subprocess.Popen([sys.executable, "-m", "services.launcher"], env=env, stdout=out, stderr=out)
    pair = Pair(launcher, f"http://127.0.0.1:{ar_port}", f"http://127.0.0.1:{dit_port}", log)
    try:
        wait_for(lambda: ready(pair.ar_url), READY_TIMEOUT, "the pair is ready")
        yield pair
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGINT)
            launcher.wait(60)
