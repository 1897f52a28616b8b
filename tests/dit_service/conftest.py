from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from dit_service.app import create_dit_app
from dit_service.model import DitModel
from dit_service.settings import DitSettings
from services.model_card import MODEL_CARD_FILE
from tests.dit_service.handoff_requests import AR_MODEL, TOKEN
from tests.support.live_server import LiveServer

# Bitwise image comparisons need a fixed intra-op thread count; one also suits a shared 2-core box.
torch.set_num_threads(1)

BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "checkpoints" / "build_tiny_qwen_image.py"


def load_build_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_tiny_qwen_image", BUILD_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def build_script() -> ModuleType:
    return load_build_script()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, build_script) -> Path:
    out = tmp_path_factory.mktemp("models") / "qwen-image-tiny"
    assert build_script.main(["--out", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint) -> DitModel:
    return DitModel.load(tiny_checkpoint, "cpu", "float32")


def start_server(tiny_checkpoint: Path, **overrides) -> LiveServer:
    settings = DitSettings(
        model_dir=tiny_checkpoint,
        handoff_token=TOKEN,
        expected_model=AR_MODEL,
        **overrides,
    )
    return LiveServer(create_dit_app(settings)).start().wait_ready()


@pytest.fixture(scope="session")
def dit_server(tiny_checkpoint) -> Iterator[LiveServer]:
    """Small caps so oversize cases are cheap to provoke; a short stall timeout; two runs at once."""
    server = start_server(
        tiny_checkpoint,
        stall_timeout_seconds=1.0,
        max_frame_payload_bytes=64 << 10,
        max_buffer_bytes=4 << 20,
        max_sequence_length=64,
        max_pipeline_runs=2,
        pipeline_queue_size=4,
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def narrow_server(tiny_checkpoint) -> Iterator[LiveServer]:
    """Room for exactly one handoff and one pipeline run, nothing queued."""
    server = start_server(
        tiny_checkpoint,
        max_concurrent_handoffs=1,
        max_pipeline_runs=1,
        pipeline_queue_size=0,
        max_inference_steps=400,
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def layer_8_server(tiny_checkpoint, tmp_path_factory) -> Iterator[LiveServer]:
    """The tiny model with a card that says it was trained on the AR's layer 8, as the demo model's does."""
    model_dir = tmp_path_factory.mktemp("carded") / "qwen-image-tiny"
    shutil.copytree(tiny_checkpoint, model_dir)
    (model_dir / MODEL_CARD_FILE).write_text(json.dumps({"rows": {"layers": [8]}}))
    server = start_server(model_dir)
    yield server
    server.stop()
