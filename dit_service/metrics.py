"""The DiT service's Prometheus families. Base units, low-cardinality labels, never request ids.

Labelled families whose label values are known up front start at zero for each value, so the
first failure is an increase ``rate()`` and alerts can see. The GPU memory gauges exist only when
the pipeline runs on CUDA.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import get_args

import torch
from prometheus_client import CollectorRegistry, Gauge

from dit_service.settings import DitSettings
from services.app_metrics import AppMetrics
from services.metrics import LATENCY_BUCKETS, PIXEL_BUCKETS, Families
from services.version import VERSION
from shared.diffusion import STEP_CACHE_METHODS, OutputFormat
from shared.errors import HandoffError

# A sender that goes away mid-handoff is a failure of its own kind (no HandoffError says so).
CLIENT_DISCONNECTED = "client_disconnected"
PIPELINE_FAILURE_REASONS = ("error", CLIENT_DISCONNECTED)


def handoff_failure_reasons() -> list[str]:
    """Every HandoffError's code and a sender that went away."""
    kinds: list[type[HandoffError]] = [HandoffError]
    for kind in kinds:
        kinds.extend(kind.__subclasses__())
    return sorted({kind.code for kind in kinds} | {CLIENT_DISCONNECTED})


@asynccontextmanager
async def waiting_for(slots: asyncio.Semaphore, waiting: Gauge) -> AsyncIterator[None]:
    """Holds one of ``slots``; ``waiting`` counts the callers still waiting for theirs (cancelled ones leave)."""
    with waiting.track_inprogress():
        await slots.acquire()
    try:
        yield
    finally:
        slots.release()


class DitMetrics:
    def __init__(self, registry: CollectorRegistry, cuda_device: torch.device | None = None) -> None:
        self.app = AppMetrics(registry, "dit")
        f = Families(registry, "dit")
        self.handoffs_in_flight = f.gauge("handoffs_in_flight", "Handoffs whose frames are being received.")
        self.handoff_received_bytes = f.counter("handoff_received_bytes", "Handoff body bytes received.")
        self.handoff_received_frames = f.counter("handoff_received_frames", "Handoff frames parsed.")
        self.handoff_failures = f.counter(
            "handoff_failures",
            "Handoffs that ended without a complete, accepted stream, by reason (the error code).",
            ("reason",),
            start=handoff_failure_reasons(),
        )
        self.handoff_receive_seconds = f.histogram(
            "handoff_receive_seconds", "From the first byte of a handoff to its accepted close.", LATENCY_BUCKETS
        )
        self.handoff_buffer_bytes = f.gauge("handoff_buffer_bytes", "Row-buffer bytes currently allocated by handoffs.")
        self.handoff_buffer_idle_bytes = f.gauge(
            "handoff_buffer_idle_bytes", "Released row buffers kept warm for reuse."
        )
        self.pipeline_queue_depth = f.gauge("pipeline_queue_depth", "Completed handoffs waiting for a pipeline run.")
        self.pipeline_queue_capacity = f.gauge(
            "pipeline_queue_capacity",
            "Completed handoffs that may wait for a pipeline run (ARDIT_DIT_PIPELINE_QUEUE_SIZE).",
        )
        self.queue_wait_seconds = f.histogram("queue_wait_seconds", "Wait for a pipeline slot.", LATENCY_BUCKETS)
        self.denoise_seconds = f.histogram("denoise_seconds", "Denoising loop per image.", LATENCY_BUCKETS)
        self.denoise_step_seconds = f.histogram(
            "denoise_step_seconds",
            "One denoising step (previews excluded; an image's first step includes the pipeline's set-up).",
            LATENCY_BUCKETS,
        )
        self.step_cache_passes = f.counter(
            "step_cache_passes",
            "Transformer passes of runs with a step cache, by method and outcome: computed (a full pass) or "
            "reused (the hook skipped or extrapolated the blocks). A CFG step is two passes.",
            ("method", "outcome"),
        )
        for method in STEP_CACHE_METHODS:  # every series exists from the start: a rate of 0, not no data
            for outcome in ("computed", "reused"):
                self.step_cache_passes.labels(method, outcome)
        self.vae_decode_seconds = f.histogram("vae_decode_seconds", "VAE decode per image.", LATENCY_BUCKETS)
        self.encode_seconds = f.histogram("encode_seconds", "Image file encoding per image.", LATENCY_BUCKETS)
        self.request_seconds = f.histogram(
            "request_seconds", "Whole /v1/handoff exchange, first byte to last result frame.", LATENCY_BUCKETS
        )
        self.images = f.counter(
            "images", "Final images produced, by format.", ("format",), start=get_args(OutputFormat)
        )
        self.image_pixels = f.histogram("image_pixels", "Size of each final image, width x height.", PIXEL_BUCKETS)
        self.pipeline_runs_in_flight = f.gauge("pipeline_runs_in_flight", "Pipeline runs executing now.")
        self.pipeline_failures = f.counter(
            "pipeline_failures",
            "Pipeline runs that did not finish, by reason (error, client_disconnected).",
            ("reason",),
            start=PIPELINE_FAILURE_REASONS,
        )
        self.build_info = f.info("build", "Version, model tag, dtype and device.")
        self.gpu_memory_allocated_bytes, self.gpu_memory_reserved_bytes = _gpu_memory_gauges()
        if cuda_device is not None and cuda_device.type == "cuda":
            self._export_gpu_memory(registry, cuda_device)

    def _export_gpu_memory(self, registry: CollectorRegistry, device: torch.device) -> None:
        self.gpu_memory_allocated_bytes.set_function(lambda: torch.cuda.memory_allocated(device))
        self.gpu_memory_reserved_bytes.set_function(lambda: torch.cuda.memory_reserved(device))
        registry.register(self.gpu_memory_allocated_bytes)
        registry.register(self.gpu_memory_reserved_bytes)

    @classmethod
    def of_service(cls, registry: CollectorRegistry, settings: DitSettings) -> DitMetrics:
        """The families of a DiT running with ``settings``: its build and its queue's capacity set."""
        metrics = cls(registry, cuda_device=torch.device(settings.device))
        metrics.pipeline_queue_capacity.set(settings.pipeline_queue_size)
        metrics.build_info.info(
            {
                "version": VERSION,
                "model": settings.expected_model or settings.model_dir.name,
                "dtype": settings.torch_dtype_name,
                "device": settings.device,
            }
        )
        return metrics


def _gpu_memory_gauges() -> tuple[Gauge, Gauge]:
    """Declared always (docs/operating.md lists them), exported only when the pipeline is on CUDA."""
    allocated = Gauge(
        "ardit_dit_gpu_memory_allocated_bytes", "GPU memory held by the pipeline's tensors (CUDA only).", registry=None
    )
    reserved = Gauge(
        "ardit_dit_gpu_memory_reserved_bytes",
        "GPU memory reserved by PyTorch's caching allocator, allocated plus cached (CUDA only).",
        registry=None,
    )
    return allocated, reserved
