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
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ar_service import __version__
from ar_service.handoff_client import HandoffFailed
from ar_service.settings import ArSettings
from services.app_metrics import AppMetrics
from services.metrics import HANDOFF_BUCKETS, LATENCY_BUCKETS, TOKEN_BUCKETS

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
    def __init__(self, registry: CollectorRegistry) -> None:
        self.app = AppMetrics(registry, "ar")
        self.requests = Counter(
            "ardit_ar_requests",
            "Validated image requests by outcome (error: refused at admission or failed).",
            ["status"],
            registry=registry,
        )
        for status in ("ok", "error"):
            self.requests.labels(status=status)
        self.requests_in_flight = Gauge("ardit_ar_requests_in_flight", "Requests being served.", registry=registry)
        self.requests_queued = Gauge("ardit_ar_requests_queued", "Requests waiting for a slot.", registry=registry)
        self.queue_wait_seconds = Histogram(
            "ardit_ar_queue_wait_seconds",
            "Time a request waited for room at the DiT.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter("ardit_ar_prompt_tokens", "Prompt tokens (all streams).", registry=registry)
        self.generated_tokens = Counter("ardit_ar_generated_tokens", "Generated tokens.", registry=registry)
        self.cached_tokens = Counter(
            "ardit_ar_cached_tokens", "Prompt tokens served from the prefix cache.", registry=registry
        )
        self.cache_creation_tokens = Counter(
            "ardit_ar_cache_creation_tokens", "Prompt tokens written into cache blocks.", registry=registry
        )
        self.cached_tokens_per_request = Histogram(
            "ardit_ar_request_cached_tokens",
            "Cached prompt tokens per request.",
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.cache_creation_tokens_per_request = Histogram(
            "ardit_ar_request_cache_creation_tokens",
            "Cache creation tokens per request.",
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.ttft_seconds = Histogram(
            "ardit_ar_time_to_first_token_seconds",
            "HTTP request received to first generated token.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.ar_seconds = Histogram(
            "ardit_ar_engine_seconds", "Engine submission to last row.", buckets=LATENCY_BUCKETS, registry=registry
        )
        self.request_seconds = Histogram(
            "ardit_ar_request_seconds",
            "Whole image request, received to answered.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.handoff_latency_seconds = Histogram(
            "ardit_ar_handoff_latency_seconds",
            "AR's last row to the DiT holding the complete conditioning.",
            buckets=HANDOFF_BUCKETS,
            registry=registry,
        )
        self.handoff_sent_bytes = Counter(
            "ardit_ar_handoff_sent_bytes", "Handoff bytes sent to the DiT.", registry=registry
        )
        self.handoff_sent_frames = Counter(
            "ardit_ar_handoff_sent_frames", "Handoff frames sent to the DiT.", registry=registry
        )
        self.handoff_failures = Counter(
            "ardit_ar_handoff_failures", "Handoffs that failed, by reason.", ["reason"], registry=registry
        )
        for reason in handoff_failure_reasons():
            self.handoff_failures.labels(reason=reason)
        self.handoffs_in_flight = Gauge(
            "ardit_ar_handoffs_in_flight", "Handoffs being streamed to the DiT.", registry=registry
        )
        self.build_info = Info(
            "ardit_ar_build", "Version, model, dtype, device, conditioning, prefix caching.", registry=registry
        )
        self.vllm = VllmFamilies()
        registry.register(self.vllm)

    @classmethod
    def of_service(cls, registry: CollectorRegistry, settings: ArSettings) -> ArMetrics:
        """The families of an AR running with ``settings``, its build described."""
        metrics = cls(registry)
        metrics.build_info.info(
            {
                "version": __version__,
                "model": settings.model_dir.name,
                "dtype": settings.dtype,
                "device": "cuda" if torch.cuda.is_available() else "cpu",
                "conditioning": settings.conditioning,
                "prefix_caching": str(settings.enable_prefix_caching).lower(),
            }
        )
        return metrics
