"""Where the local checkpoints live: ``$ARDIT_CACHE_DIR/models/<name>`` (default ``~/.cache/ardit``).

``make checkpoints`` builds them there; both services default to them.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_model_dir(name: str) -> Path:
    base = os.environ.get("ARDIT_CACHE_DIR") or os.path.join("~", ".cache", "ardit")
    return Path(base).expanduser() / "models" / name
