"""services/torchvision_schemas.py: in every fresh process, torchvision imports beside torch's CPU build (torch's
autoload declares its two schemas where its compiled ops do not load), so transformers' and vLLM's Qwen2-VL pieces
import; without the hook PyPI's build does not."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from services import torchvision_schemas


def fresh_process(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=os.environ | env, check=False
    )


DECISION = "from services.torchvision_schemas import declare_where_missing; print(declare_where_missing())"


def test_torchvision_imports_in_a_fresh_process_and_its_transforms_run():
    ran = fresh_process(
        "import torch, torchvision\n"
        "from torchvision.transforms.v2 import functional\n"
        "assert functional.resize(torch.zeros(3, 8, 8), [4, 4]).shape == (3, 4, 4)\n"
        "assert hasattr(torch.ops.torchvision, 'nms')\n" + DECISION
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.split()[-1] in {"declared", "native"}


def test_qwen2_vls_processor_and_vllms_qwen2_5_vl_module_import_in_a_fresh_process():
    ran = fresh_process(
        "from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor\n"
        "import vllm.model_executor.models.qwen2_5_vl\n"
    )
    assert ran.returncode == 0, ran.stderr[-2000:]


def test_without_the_hook_pypis_torchvision_does_not_import_where_its_compiled_ops_do_not_load():
    decided = fresh_process(DECISION)
    if decided.stdout.split()[-1] == "native":
        pytest.skip("torchvision's compiled ops load on this machine: it defines its schemas itself")
    ran = fresh_process("import torchvision", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert ran.returncode != 0 and "torchvision::nms does not exist" in ran.stderr


def test_declaring_twice_declares_once_and_after_torchvisions_registrations_it_is_too_late(monkeypatch):
    importlib.import_module("torchvision")  # its registrations have run in this process

    first = torchvision_schemas.declare_where_missing()
    assert torchvision_schemas.declare_where_missing() == first
    monkeypatch.setattr(torchvision_schemas, "_library", None)
    assert torchvision_schemas.declare_where_missing() == "too late"
