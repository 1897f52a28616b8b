"""``python -m dit_service``: its thread count, and the process itself, configured only through the environment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from dit_service.__main__ import intra_op_threads
from dit_service.settings import DitSettings
from services.model_card import MODEL_CARD_FILE, PIPELINE_INDEX
from shared.result_frames import RESERVATION_HEADER, RESERVATIONS_PATH
from tests.dit_service.handoff_requests import AR_MODEL, complete_handoff, handoff_headers, hidden_rows, post_handoff
from tests.support.launched_pair import ready
from tests.support.otlp_collector import OtlpCollector
from tests.support.ports import free_port
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]


def settings_for(model_dir: Path, cpu_threads: int | None, **settings: Any) -> DitSettings:
    (model_dir / PIPELINE_INDEX).write_text('{"_class_name": "QwenImagePipeline"}')
    (model_dir / MODEL_CARD_FILE).write_text("{}" if cpu_threads is None else f'{{"cpu_threads": {cpu_threads}}}')
    return DitSettings(model_dir=model_dir, **settings)


def test_on_cpu_the_model_cards_thread_count_is_used(tmp_path):
    assert intra_op_threads(settings_for(tmp_path, 1)) == 1


def test_the_operators_thread_count_wins_over_the_cards(tmp_path):
    assert intra_op_threads(settings_for(tmp_path, 1, torch_threads=3)) == 3


def test_without_a_count_from_either_torch_keeps_its_default(tmp_path):
    assert intra_op_threads(settings_for(tmp_path, None)) is None


def test_on_cuda_the_cards_cpu_thread_count_does_not_apply(tmp_path):
    assert intra_op_threads(settings_for(tmp_path, 1, device="cuda")) is None


@contextmanager
def dit_process(checkpoint: Path, **environment: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``python -m dit_service`` with ``environment`` added, ready; yields its URL and process."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "ARDIT_DIT_MODEL_DIR": str(checkpoint),
        "ARDIT_DIT_PORT": str(port),
        "ARDIT_DIT_TORCH_THREADS": "1",
        "ARDIT_DIT_EXPECTED_MODEL": AR_MODEL,
        "ARDIT_HANDOFF_TOKEN": "from-env",
        **environment,
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "dit_service"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    output = process.stdout
    assert output is not None
    url = f"http://127.0.0.1:{port}"

    def running_and_ready() -> bool:
        assert process.poll() is None, output.read().decode()  # it exited: what it said
        return ready(url)

    try:
        wait_for(running_and_ready, 120, "the DiT is ready", every=0.2)
        yield url, process
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.slow
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


@pytest.mark.slow
def test_module_entrypoint_serves_handoffs(tiny_checkpoint):
    with dit_process(tiny_checkpoint) as (url, _):
        answer = post_handoff(url, complete_handoff(hidden_rows(6)), headers=handoff_headers("from-env"))
    assert answer.status == 200 and answer.kinds == ["image", "done"]


@pytest.mark.slow
def test_otel_variables_send_the_handoff_spans_to_a_collector_in_the_senders_trace(tiny_checkpoint):
    trace_id, sender_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with OtlpCollector() as collector:
        environment = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
        with dit_process(tiny_checkpoint, **environment) as (url, _):
            parts = complete_handoff(hidden_rows(6), traceparent=f"00-{trace_id}-{sender_span}-01")
            assert post_handoff(url, parts, headers=handoff_headers("from-env")).status == 200
            wait_for(lambda: len(collector.spans) >= 6, 30, "six spans exported", every=0.1)
    spans = {span.name: span for span in collector.spans}
    assert set(spans) == {
        "ardit.dit.handoff",
        "ardit.dit.receive",
        "ardit.dit.queue",
        "ardit.dit.denoise",
        "ardit.dit.vae_decode",
        "ardit.dit.encode",
    }
    assert {span.trace_id for span in collector.spans} == {trace_id}
    assert {span.service for span in collector.spans} == {"ardit-dit"}
    handoff = spans.pop("ardit.dit.handoff")
    assert handoff.parent_span_id == sender_span
    assert all(span.parent_span_id == handoff.span_id for span in spans.values())


@pytest.mark.slow
def test_sigint_stops_the_service_with_exit_code_0_and_no_traceback(tiny_checkpoint):
    # What the launcher sends each service on Ctrl-C.
    with dit_process(tiny_checkpoint) as (_, process):
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=30)
    assert process.returncode == 0
    assert b"Traceback" not in output, output.decode()[-3000:]


@pytest.mark.slow
def test_sigterm_drains_a_reserved_handoff_refuses_new_places_and_exits_0(tiny_checkpoint):
    # What a rollout or a scale-down sends: an AR that reserved a place before the signal still gets its image.
    with dit_process(tiny_checkpoint) as (url, process):
        headers = handoff_headers("from-env")
        reserved = httpx.post(f"{url}{RESERVATIONS_PATH}", headers=headers).json()["reservation"]
        process.send_signal(signal.SIGTERM)
        wait_for(lambda: not ready(url), 10, "readiness turns 503")
        readyz = httpx.get(f"{url}/readyz")
        assert readyz.status_code == 503 and readyz.json()["reason"].startswith("draining")
        refused = httpx.post(f"{url}{RESERVATIONS_PATH}", headers=headers)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert refused.headers["retry-after"] == "1"
        parts = complete_handoff(hidden_rows(6))
        answer = post_handoff(url, parts, headers={**headers, RESERVATION_HEADER: reserved})
        assert answer.status == 200 and answer.kinds == ["image", "done"]
        output, _ = process.communicate(timeout=30)
    assert process.returncode == 0 and b"drained after" in output, output.decode()[-3000:]
    assert b"Traceback" not in output, output.decode()[-3000:]
