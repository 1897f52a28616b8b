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
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

import dit_service.errors  # noqa: F401  (defines the DiT's own HandoffError kinds, whose codes are reasons)
from dit_service import __version__
from dit_service.settings import DitSettings
from services.app_metrics import AppMetrics
from services.metrics import LATENCY_BUCKETS, PIXEL_BUCKETS
from shared.diffusion import OutputFormat
from shared.errors import HandoffError

# A sender that goes away mid-handoff is a failure of its own kind (no HandoffError says so).
CLIENT_DISCONNECTED = "client_disconnected"
PIPELINE_FAILURE_REASONS = ("error", CLIENT_DISCONNECTED)


def handoff_failure_reasons() -> list[str]:
    """Every HandoffError's code (the DiT's own included) and a sender that went away."""
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
        self.handoffs_in_flight = Gauge(
            "ardit_dit_handoffs_in_flight", "Handoffs whose frames are being received.", registry=registry
        )
        self.handoff_received_bytes = Counter(
            "ardit_dit_handoff_received_bytes", "Handoff body bytes received.", registry=registry
        )
        self.handoff_received_frames = Counter(
            "ardit_dit_handoff_received_frames", "Handoff frames parsed.", registry=registry
        )
        self.handoff_failures = Counter(
            "ardit_dit_handoff_failures",
            "Handoffs that ended without a complete, accepted stream, by reason (the error code).",
            ["reason"],
            registry=registry,
        )
        for reason in handoff_failure_reasons():
            self.handoff_failures.labels(reason)
        self.handoff_receive_seconds = Histogram(
            "ardit_dit_handoff_receive_seconds",
            "From the first byte of a handoff to its accepted close.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.handoff_buffer_bytes = Gauge(
            "ardit_dit_handoff_buffer_bytes", "Row-buffer bytes currently allocated by handoffs.", registry=registry
        )
        self.handoff_buffer_idle_bytes = Gauge(
            "ardit_dit_handoff_buffer_idle_bytes", "Released row buffers kept warm for reuse.", registry=registry
        )
        self.pipeline_queue_depth = Gauge(
            "ardit_dit_pipeline_queue_depth", "Completed handoffs waiting for a pipeline run.", registry=registry
        )
        self.pipeline_queue_capacity = Gauge(
            "ardit_dit_pipeline_queue_capacity",
            "Completed handoffs that may wait for a pipeline run (ARDIT_DIT_PIPELINE_QUEUE_SIZE).",
            registry=registry,
        )
        self.queue_wait_seconds = Histogram(
            "ardit_dit_queue_wait_seconds", "Wait for a pipeline slot.", buckets=LATENCY_BUCKETS, registry=registry
        )
        self.denoise_seconds = Histogram(
            "ardit_dit_denoise_seconds", "Denoising loop per image.", buckets=LATENCY_BUCKETS, registry=registry
        )
        self.denoise_step_seconds = Histogram(
            "ardit_dit_denoise_step_seconds",
            "One denoising step (previews excluded; an image's first step includes the pipeline's set-up).",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.vae_decode_seconds = Histogram(
            "ardit_dit_vae_decode_seconds", "VAE decode per image.", buckets=LATENCY_BUCKETS, registry=registry
        )
        self.encode_seconds = Histogram(
            "ardit_dit_encode_seconds", "Image file encoding per image.", buckets=LATENCY_BUCKETS, registry=registry
        )
        self.request_seconds = Histogram(
            "ardit_dit_request_seconds",
            "Whole /v1/handoff exchange, first byte to last result frame.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.images = Counter("ardit_dit_images", "Final images produced, by format.", ["format"], registry=registry)
        for output_format in get_args(OutputFormat):
            self.images.labels(output_format)
        self.image_pixels = Histogram(
            "ardit_dit_image_pixels",
            "Size of each final image, width x height.",
            buckets=PIXEL_BUCKETS,
            registry=registry,
        )
        self.pipeline_runs_in_flight = Gauge(
            "ardit_dit_pipeline_runs_in_flight", "Pipeline runs executing now.", registry=registry
        )
        self.pipeline_failures = Counter(
            "ardit_dit_pipeline_failures",
            "Pipeline runs that did not finish, by reason (error, client_disconnected).",
            ["reason"],
            registry=registry,
        )
        for reason in PIPELINE_FAILURE_REASONS:
            self.pipeline_failures.labels(reason)
        # Declared always (the README lists them), exported only when the pipeline is on CUDA.
        self.gpu_memory_allocated_bytes = Gauge(
            "ardit_dit_gpu_memory_allocated_bytes",
            "GPU memory held by the pipeline's tensors (CUDA only).",
            registry=None,
        )
        self.gpu_memory_reserved_bytes = Gauge(
            "ardit_dit_gpu_memory_reserved_bytes",
            "GPU memory reserved by PyTorch's caching allocator, allocated plus cached (CUDA only).",
            registry=None,
        )
        if cuda_device is not None and cuda_device.type == "cuda":
            self.gpu_memory_allocated_bytes.set_function(lambda: torch.cuda.memory_allocated(cuda_device))
            self.gpu_memory_reserved_bytes.set_function(lambda: torch.cuda.memory_reserved(cuda_device))
            registry.register(self.gpu_memory_allocated_bytes)
            registry.register(self.gpu_memory_reserved_bytes)
        self.build_info = Info("ardit_dit_build", "Version, model tag, dtype and device.", registry=registry)

    @classmethod
    def of_service(cls, registry: CollectorRegistry, settings: DitSettings) -> DitMetrics:
        """The families of a DiT running with ``settings``: its build and its queue's capacity set."""
        metrics = cls(registry, cuda_device=torch.device(settings.device))
        metrics.pipeline_queue_capacity.set(settings.pipeline_queue_size)
        metrics.build_info.info(
            {
                "version": __version__,
                "model": settings.expected_model or settings.model_dir.name,
                "dtype": settings.torch_dtype_name,
                "device": settings.device,
            }
        )
        return metrics
