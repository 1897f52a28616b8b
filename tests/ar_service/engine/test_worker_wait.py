"""A CPU engine's worker waits for its next step asleep: within vLLM's busy window its queue reader
sleeps between polls instead of spinning on a core the DiT needs, and still sees every write."""

from __future__ import annotations

import threading
import time

import pytest
import zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.utils.network_utils import get_open_zmq_ipc_path

from ar_service.engine import worker_wait


def reader_and_writer() -> tuple[SpinCondition, SpinCondition]:
    context, address = zmq.Context(), get_open_zmq_ipc_path()
    writer = SpinCondition(is_reader=False, context=context, notify_address=address)
    return SpinCondition(is_reader=True, context=context, notify_address=address), writer


def test_a_reader_within_its_busy_window_sleeps_between_polls():
    assert worker_wait.installed()
    reader, _ = reader_and_writer()
    reader.record_read()  # the window vLLM spins through: a second after each read
    polls, started, cpu = 0, time.monotonic(), time.thread_time()
    while time.monotonic() - started < 0.3:
        reader.wait(timeout_ms=1000)
        polls += 1
    busy = (time.thread_time() - cpu) / (time.monotonic() - started)
    # vLLM's own wait yields the core and takes it straight back: this thread would be busy ~100%.
    assert busy < 0.25, f"the reader used {busy:.0%} of a core while waiting"
    assert polls > 100, "it still polls the queue often within the window"


def test_a_reader_past_its_busy_window_waits_on_the_notification_and_wakes_for_it():
    reader, writer = reader_and_writer()
    reader.last_read = time.monotonic() - reader.busy_loop_s - 1
    time.sleep(0.2)  # the subscription reaches the publisher
    notify = threading.Timer(0.2, writer.notify)
    notify.start()
    started = time.monotonic()
    reader.wait(timeout_ms=5000)
    assert 0.15 < time.monotonic() - started < 2


@pytest.mark.slow
def test_the_running_engine_leaves_vllms_wait_as_it_ships_by_default(stack):
    assert stack.settings.cpu_worker_busy_poll
    assert not stack.runtime.engine.vllm.vllm_config.parallel_config.worker_extension_cls
