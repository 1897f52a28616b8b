"""services/dtype.py: bf16 where the hardware multiplies it, fp32 on other CPUs."""

from __future__ import annotations

import pytest

from services import dtype
from services.dtype import cpu_has_native_bf16, default_dtype

CPUINFO = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f {extra}\nbogomips\t: 4000\n"


@pytest.mark.parametrize("extra, native", [("avx512_bf16", True), ("amx_bf16 amx_tile", True), ("avx512_vnni", False)])
def test_a_cpu_multiplies_bf16_natively_with_avx512_bf16_or_amx(tmp_path, extra, native):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO.format(extra=extra))
    assert cpu_has_native_bf16(cpuinfo) is native


def test_a_machine_without_proc_cpuinfo_is_taken_for_one_without(tmp_path):
    assert cpu_has_native_bf16(tmp_path / "absent") is False


@pytest.mark.parametrize("native, expected", [(True, "bfloat16"), (False, "float32")])
def test_a_cpu_computes_in_bf16_only_where_it_is_native(monkeypatch, native, expected):
    monkeypatch.setattr(dtype, "cpu_has_native_bf16", lambda: native)
    assert default_dtype("cpu") == expected
    assert default_dtype("cuda") == "bfloat16"
