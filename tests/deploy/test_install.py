"""What `make setup` runs before and while it installs: the Python check and the torch CPU build's fallback."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from tests.deploy.compose_cli import ROOT

INSTALL = ROOT / "deploy" / "install"
UNREACHABLE_INDEX = "http://127.0.0.1:9/whl/cpu"


def test_a_python_the_project_does_not_support_is_refused_at_once_naming_the_one_to_use(tmp_path):
    # This interpreter against a pyproject that asks for a newer one.
    (tmp_path / "deploy" / "install").mkdir(parents=True)
    shutil.copy(INSTALL / "check_python.py", tmp_path / "deploy" / "install")
    wanted = f"3.{sys.version_info.minor + 1}"
    (tmp_path / "pyproject.toml").write_text(f'[project]\nrequires-python = ">={wanted}"\n')
    result = subprocess.run(
        [sys.executable, str(tmp_path / "deploy" / "install" / "check_python.py")], capture_output=True, text=True
    )
    assert result.returncode == 1
    assert not (tmp_path / ".venv").exists()  # refused before anything is made or fetched
    assert f"python{wanted}" in result.stderr and ".".join(map(str, sys.version_info[:3])) in result.stderr


def test_the_supported_python_passes_the_check():
    result = subprocess.run([sys.executable, str(INSTALL / "check_python.py")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert re.search(r'^requires-python = ">=3\.11,<3\.12"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)


def test_without_a_source_for_the_torch_cpu_build_the_install_fails_fast_naming_the_index_it_tried():
    """The machine's own pip sources hidden (no config, no find-links): the torch build is not on PyPI, so the
    script turns to the PyTorch CPU index, here one that cannot be reached, and stops before installing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    env |= {"PIP_CONFIG_FILE": os.devnull, "ARDIT_TORCH_CPU_INDEX": UNREACHABLE_INDEX}
    result = subprocess.run(
        [str(INSTALL / "pip_install.sh"), sys.executable, str(ROOT / "requirements.txt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard
    )
    assert result.returncode == 1
    assert f"adding PyTorch's CPU index {UNREACHABLE_INDEX}" in result.stdout
    assert f"could not get torch==2.13.0+cpu from {UNREACHABLE_INDEX}" in result.stderr
