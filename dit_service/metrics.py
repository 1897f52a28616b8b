"""The DiT service's Prometheus families. Base units, low-cardinality labels, never request ids."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from services.metrics import LATENCY_BUCKETS


class DitMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.handoffs_in_flight = Gauge(
            "ardit_dit_handoffs_in_flight", "Handoffs whose frames are being received.", registry=registry
        )
        self.handoff_bytes_received = Counter(
            "ardit_dit_handoff_bytes_received", "Handoff body bytes received.", registry=registry
        )
        self.handoff_frames_received = Counter(
            "ardit_dit_handoff_frames_received", "Handoff frames parsed.", registry=registry
        )
        self.handoff_failures = Counter(
            "ardit_dit_handoff_failures",
            "Handoffs that ended without a complete, accepted stream, by reason (the error code).",
            ["reason"],
            registry=registry,
        )
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
        self.queue_wait_seconds = Histogram(
            "ardit_dit_queue_wait_seconds", "Wait for a pipeline slot.", buckets=LATENCY_BUCKETS, registry=registry
        )
        self.denoise_seconds = Histogram(
            "ardit_dit_denoise_seconds", "Denoising loop per image.", buckets=LATENCY_BUCKETS, registry=registry
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
        self.images = Counter("ardit_dit_images", "Final images produced.", ["format"], registry=registry)
        self.pipeline_runs_in_flight = Gauge(
            "ardit_dit_pipeline_runs_in_flight", "Pipeline runs executing now.", registry=registry
        )
        self.pipeline_failures = Counter(
            "ardit_dit_pipeline_failures",
            "Pipeline runs that did not finish, by reason (error, client_disconnected).",
            ["reason"],
            registry=registry,
        )
        self.build_info = Info("ardit_dit_build", "Version, model tag, dtype and device.", registry=registry)
