"""What every side-by-side benchmark here records: the machine and its load, and paired ratios.

The benchmark machines are shared (other test runs, a training run), so a figure is only as good
as its pairing: each benchmark measures its sides back to back within a repetition, in rotating
order, and summarises the per-repetition ratio (median, p10-p90) rather than the ratio of means.
"""

from __future__ import annotations

import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import torch

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[1]


def use_this_checkout() -> None:
    """Import ar_service/dit_service/shared from this checkout, not from an installed copy."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def child(args: list[str], **popen: Any) -> subprocess.Popen[bytes]:
    """A process a benchmark starts (a service, a receiver) that gets SIGTERM when the benchmark dies,
    however it dies: a benchmark stopped mid-run leaves no AR, DiT or engine behind."""
    use_this_checkout()
    from services.lifetime import die_with_parent

    return subprocess.Popen(args, preexec_fn=lambda: die_with_parent(signal.SIGTERM), **popen)


def wait_ready(url: str, process: subprocess.Popen[bytes], seconds: float = 900) -> None:
    """Returns once ``url``'s ``/readyz`` answers 200; raises if ``process`` (what serves it) exits first,
    or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while not _answers_ready(url):
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError(f"{url} did not become ready")
        time.sleep(1)


def _answers_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


class BackgroundLoad:
    """``cores`` processes that each keep one core busy (a Python loop that never sleeps), for a run on a
    machine something else is using, the same for every side."""

    def __init__(self, cores: int) -> None:
        self.cores = cores
        self._spinners: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        self._spinners = [child([sys.executable, "-c", "while True: pass"]) for _ in range(self.cores)]

    def stop(self) -> None:
        for spinner in self._spinners:
            spinner.kill()
            spinner.wait()
        self._spinners = []


def free_port() -> int:
    """A free loopback port, for a server a benchmark starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def machine() -> dict:
    return {
        "node": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cores": psutil.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def load() -> dict:
    """``uptime``'s load averages and what is free now: how shared the machine was."""
    one, five, fifteen = os.getloadavg()
    return {
        "load_1m": round(one, 2),
        "load_5m": round(five, 2),
        "load_15m": round(fifteen, 2),
        "available_memory_gb": round(psutil.virtual_memory().available / 2**30, 1),
    }


def spread(values: list[float]) -> dict[str, float]:
    """Median with the 10th-90th percentile range (inclusive method: no extrapolation)."""
    if not values:
        return {}
    if len(values) == 1:
        return {"p50": values[0], "p10": values[0], "p90": values[0], "n": 1}
    cuts = statistics.quantiles(values, n=10, method="inclusive")
    return {"p50": statistics.median(values), "p10": cuts[0], "p90": cuts[-1], "n": len(values)}


def role(process: psutil.Process) -> str:
    """What a process of a served system's tree is for, from its command line (one name per role, so that
    runs and systems compare process by process)."""
    command = " ".join(process.cmdline())
    for marker, name in (
        ("VLLM::EngineCore", "vLLM engine core (scheduler, model, KV cache)"),
        ("-m ar_service", "AR API process (HTTP, tokenizer, AsyncLLM client)"),
        ("-m dit_service", "DiT (pipeline, weights, renders)"),
        ("services.launcher", "launcher"),
        ("resource_tracker", "multiprocessing resource tracker"),
        ("peer_server.py", "peer (LLM and DiT in one process)"),
        ("vllm-omni", "vLLM-Omni (API server, text encoder, DiT)"),
    ):
        if marker in command:
            return name
    return process.name()


def tree_cpu_by_role(process: psutil.Process) -> dict[str, float]:
    """User + system CPU seconds of a process and its descendants (alive ones), summed by ``role``."""
    seconds: dict[str, float] = {}
    for p in [process, *process.children(recursive=True)]:
        try:
            times, name = p.cpu_times(), role(p)
        except psutil.Error:
            continue
        seconds[name] = seconds.get(name, 0.0) + times.user + times.system
    return seconds


def tree_rss_by_role(process: psutil.Process) -> dict[str, int]:
    rss: dict[str, int] = {}
    for p in [process, *process.children(recursive=True)]:
        try:
            size, name = p.memory_info().rss, role(p)
        except psutil.Error:
            continue
        rss[name] = rss.get(name, 0) + size
    return rss


def tree_cpu_seconds(process: psutil.Process) -> float:
    """User + system CPU seconds of a process and all its descendants (alive ones)."""
    return sum(tree_cpu_by_role(process).values())


def tree_rss(process: psutil.Process) -> int:
    return sum(tree_rss_by_role(process).values())
