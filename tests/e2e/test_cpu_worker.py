"""vLLM's CPU worker asked not to busy-poll (``ARDIT_AR_CPU_WORKER_BUSY_POLL=false``) leaves its core
to the DiT between steps: in the second after a request it is all but idle, where vLLM's own wait
keeps it busy for that whole second."""

from __future__ import annotations

import time

import psutil
import pytest

from tests.support.launched_pair import launched_pair

pytestmark = pytest.mark.slow


def engine_worker(ar: psutil.Process) -> psutil.Process:
    for process in ar.children(recursive=True):
        if "VLLM::Worker" in " ".join(process.cmdline()):
            return process
    raise LookupError("the AR runs no vLLM worker process")


def busy_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def test_a_worker_that_does_not_busy_poll_is_idle_in_the_second_after_a_request(tmp_path):
    with launched_pair(tmp_path / "launcher.log", settings={"ARDIT_AR_CPU_WORKER_BUSY_POLL": "false"}) as pair:
        worker = engine_worker(pair.service("ar_service"))
        assert pair.generate().status_code == 200
        before = busy_seconds(worker)
        time.sleep(1.0)
        busy = busy_seconds(worker) - before
    assert busy < 0.2, f"the worker used {busy:.2f} s of CPU in the second after its last step"
