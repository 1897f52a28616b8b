"""Importing the DiT leaves out the GGUF loader diffusers would import because the package is installed, and
what that loader imports (mistral_common, OpenCV): 48 MB of the DiT's memory."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_dit_imports_neither_gguf_nor_mistral_common_nor_opencv():
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, dit_service.app; "
            "print(' '.join(sorted({n.split('.')[0] for n, m in sys.modules.items() if m is not None})))",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    assert "diffusers" in loaded
    assert not {"gguf", "mistral_common", "cv2"} & set(loaded)
