"""The entry point vLLM-Omni calls (group ``vllm_omni.platform_plugins``) while it picks its platform."""

from __future__ import annotations

CPU_PLATFORM = "ardit_omni_cpu.platform.CpuOmniPlatform"


def cpu_omni_platform_plugin() -> str | None:
    """Activate the CPU platform only where torch sees no accelerator.

    vLLM-Omni runs every built-in detector (CUDA, ROCm, NPU, XPU, MUSA) and this one; an out-of-tree platform that
    answers wins over the built-ins. On a GPU machine this returns None, so the venv would still run on the GPU.
    """
    import torch

    if torch.accelerator.current_accelerator() is not None:
        return None
    return CPU_PLATFORM
