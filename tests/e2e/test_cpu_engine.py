"""On CPU the AR's model runs in vLLM's engine core process, as vLLM runs it at one GPU: there is no
worker process that imports torch and vLLM again and, for a second after every step, spins on the
queue that feeds it, on a core the DiT needs."""

from __future__ import annotations

import time

import psutil
import pytest

from tests.support.launched_pair import launched_pair

pytestmark = pytest.mark.slow


def busy_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def test_the_model_runs_in_the_engine_core_which_is_idle_in_the_second_after_a_request(tmp_path):
    with launched_pair(tmp_path / "launcher.log") as pair:
        engine = pair.service("ar_service").children(recursive=True)
        commands = [" ".join([process.name(), *process.cmdline()]) for process in engine]
        [core] = [process for process, command in zip(engine, commands, strict=True) if "EngineCore" in command]
        assert not [command for command in commands if "VLLM::Worker" in command], commands
        assert not core.children(recursive=True), "the engine core runs no process of its own"
        assert pair.generate().status_code == 200
        before = busy_seconds(core)
        time.sleep(1.0)
        busy = busy_seconds(core) - before
    # vLLM's worker process, where the model ran before, spent the whole second on a core.
    assert busy < 0.2, f"the engine core used {busy:.2f} s of CPU in the second after its last step"
