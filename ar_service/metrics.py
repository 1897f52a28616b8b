"""The AR service's Prometheus families. Base units, low-cardinality labels, never request ids.

vLLM's own engine families (``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits``,
``vllm:kv_cache_usage_perc``, ``vllm:time_to_first_token_seconds``, ...) live in
prometheus_client's global registry; ``VllmFamilies`` re-exports those of the running engine so one
scrape of the AR service's ``/metrics`` has both.

Labelled families whose label values are known up front start at zero for each value, so the
first failure is an increase ``rate()`` and alerts can see, not a series appearing from nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ar_service.handoff_client import HandoffFailed
from ar_service.settings import ArSettings
from services.app_metrics import AppMetrics
from services.metrics import HANDOFF_BUCKETS, LATENCY_BUCKETS, TOKEN_BUCKETS, Families
from services.version import VERSION
from shared.row_recipe import RowRecipe

# The reason a handoff failed: a HandoffFailed's ``reason``, or the AR's own row buffer overflowing.
ROW_BUFFER_OVERFLOW = "row_buffer_overflow"


def handoff_failure_reasons() -> list[str]:
    kinds: list[type[HandoffFailed]] = [HandoffFailed]
    for kind in kinds:
        kinds.extend(kind.__subclasses__())
    return sorted({kind.reason for kind in kinds} | {ROW_BUFFER_OVERFLOW})


class VllmFamilies:
    """Collector of the vLLM families of this service's engine.

    vLLM registers them in prometheus_client's global registry when its engine starts, and an engine
    started later in the same process (a restart; in tests, a second engine) unregisters them for
    its own. ``capture``, called once the engine is up, keeps that engine's collectors, so /metrics
    shows the families the running engine updates.
    """

    def __init__(self) -> None:
        self._collectors: list[Collector] = []

    def capture(self) -> None:
        # No public listing of a registry's collectors; vLLM's own unregister reads the same map.
        registered = list(REGISTRY._collector_to_names)
        self._collectors = [c for c in registered if getattr(c, "_name", "").startswith("vllm:")]

    def collect(self) -> Iterator[Metric]:
        for collector in self._collectors:
            yield from collector.collect()


class ArMetrics:
    """The AR's families, declared by what they watch: requests, the admission pace, tokens, latencies,
    handoffs, the build."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.app = AppMetrics(registry, "ar")
        f = Families(registry, "ar")
        self._declare_requests(f)
        self._declare_admission_pace(f)
        self._declare_tokens(f)
        self._declare_latencies(f)
        self._declare_handoffs(f)
        self.build_info = f.info("build", "Version, model, dtype, device, conditioning, prefix caching.")
        self.vllm = VllmFamilies()
        registry.register(self.vllm)

    def _declare_requests(self, f: Families) -> None:
        self.requests = f.counter(
            "requests",
            "Validated image requests by outcome (error: refused at admission or failed).",
            ("status",),
            start=("ok", "error"),
        )
        self.requests_in_flight = f.gauge("requests_in_flight", "Requests being served.")
        self.requests_queued = f.gauge("requests_queued", "Requests waiting for a slot.")
        self.queue_wait_seconds = f.histogram(
            "queue_wait_seconds", "Time a request waited for room at the DiT.", LATENCY_BUCKETS
        )

    def _declare_admission_pace(self, f: Families) -> None:
        # The pair's pace as admission prices waits, in its three parts (``Pace``); until the first completion the
        # DiTs' warm-up pace prices them, and these read 0.
        self.admission_seconds_per_request = f.gauge(
            "admission_seconds_per_request",
            "The pair's measured pace, its part per request: seconds a request costs whatever it asks (0 before a "
            "completion).",
        )
        self.admission_seconds_per_megapixel = f.gauge(
            "admission_seconds_per_megapixel",
            "The pair's measured pace, its part per megapixel of the images asked: the VAE, the encoder (0 before a "
            "completion).",
        )
        self.admission_seconds_per_work = f.gauge(
            "admission_seconds_per_work",
            "The pair's measured pace, its part per unit of denoising: an image's step at a megapixel, twice with "
            "CFG (0 before a completion).",
        )

    def _declare_tokens(self, f: Families) -> None:
        self.prompt_tokens = f.counter("prompt_tokens", "Prompt tokens (all streams).")
        self.generated_tokens = f.counter("generated_tokens", "Generated tokens.")
        self.cached_tokens = f.counter("cached_tokens", "Prompt tokens served from the prefix cache.")
        self.cache_creation_tokens = f.counter("cache_creation_tokens", "Prompt tokens written into cache blocks.")
        # An edit model's pictures: each stream's prompt reads them; the vision tower encodes those whose embeddings
        # vLLM's encoder cache does not hold (a picture edited again is read, not encoded).
        self.pictures_read = f.counter("pictures_read", "Pictures the encoder read in prompts (all streams).")
        self.pictures_encoded = f.counter("pictures_encoded", "Pictures the vision tower encoded (all streams).")
        self.cached_tokens_per_request = f.histogram(
            "request_cached_tokens", "Cached prompt tokens per request.", TOKEN_BUCKETS
        )
        self.cache_creation_tokens_per_request = f.histogram(
            "request_cache_creation_tokens", "Cache creation tokens per request.", TOKEN_BUCKETS
        )

    def _declare_latencies(self, f: Families) -> None:
        self.ttft_seconds = f.histogram(
            "time_to_first_token_seconds", "HTTP request received to first generated token.", LATENCY_BUCKETS
        )
        self.ar_seconds = f.histogram("engine_seconds", "Engine submission to last row.", LATENCY_BUCKETS)
        self.request_seconds = f.histogram(
            "request_seconds", "Whole image request, received to answered.", LATENCY_BUCKETS
        )

    def _declare_handoffs(self, f: Families) -> None:
        self.handoff_latency_seconds = f.histogram(
            "handoff_latency_seconds", "AR's last row to the DiT holding the complete conditioning.", HANDOFF_BUCKETS
        )
        self.handoff_sent_bytes = f.counter("handoff_sent_bytes", "Handoff bytes sent to the DiT.")
        self.handoff_sent_frames = f.counter("handoff_sent_frames", "Handoff frames sent to the DiT.")
        self.handoff_failures = f.counter(
            "handoff_failures", "Handoffs that failed, by reason.", ("reason",), start=handoff_failure_reasons()
        )
        self.handoffs_in_flight = f.gauge(
            "handoffs_in_flight",
            "Requests holding a DiT place: reserving it, streaming to the DiT, awaiting the images.",
        )

    @classmethod
    def of_service(cls, registry: CollectorRegistry, settings: ArSettings, rows: RowRecipe) -> ArMetrics:
        """The families of an AR running with ``settings``, its build described."""
        metrics = cls(registry)
        metrics.build_info.info(
            {
                "version": VERSION,
                "model": settings.model_dir.name,
                "dtype": settings.engine_dtype,
                "device": "cuda" if torch.cuda.is_available() else "cpu",
                "conditioning": rows.conditioning,
                "prefix_caching": str(settings.enable_prefix_caching).lower(),
            }
        )
        return metrics
