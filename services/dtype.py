"""The dtype a service computes in when its settings name none.

bf16 on a GPU. On a CPU, bf16 where the CPU multiplies bf16 natively (AVX512-BF16 or AMX): there the
AR's engine and the DiT run it faster than fp32 and with half the memory and handoff bytes
(benchmarks/results/bf16.md); elsewhere bf16 is emulated and slower, so fp32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

DtypeName = Literal["float32", "bfloat16", "float16"]
# /proc/cpuinfo flags of CPUs that multiply bf16 in hardware.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
CPUINFO = Path("/proc/cpuinfo")


def cpu_has_native_bf16(cpuinfo: Path = CPUINFO) -> bool:
    try:
        text = cpuinfo.read_text()
    except OSError:  # not Linux: no way to tell, so the safe choice
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return bool(NATIVE_BF16_FLAGS & set(line.partition(":")[2].split()))
    return False


def default_dtype(device: Literal["cpu", "cuda"]) -> DtypeName:
    if device == "cuda":
        return "bfloat16"
    return "bfloat16" if cpu_has_native_bf16() else "float32"
