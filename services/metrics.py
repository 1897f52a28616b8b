"""What both services' Prometheus metrics share: the registry factory, the bucket definitions, and how a
family is declared (``Families``).

Each app gets its own registry (tests run several apps in one process), always with the process,
platform and GC collectors, so ``process_*`` is on both services' ``/metrics``. Buckets are defined
once here, in base units, so the same quantity is bucketed the same way on both sides.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

# Seconds: 1 ms (a warm GPU prefill, one denoise step) to 10 minutes (a long CPU render).
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
# Seconds: the handoff tail is sub-millisecond when overlapped with decoding, seconds when not.
HANDOFF_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# Pixels per image (width x height): 256², 512², 768², 1024², Qwen-Image's native 1328², 2048².
PIXEL_BUCKETS = (65536, 262144, 589824, 1048576, 1763584, 4194304)
# Tokens per request.
TOKEN_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def new_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


class Families:
    """Declares one service's families in its registry, each named ``ardit_<service>_<name>``.

    A labelled family whose label values are known up front (``start``) has each of them at zero from
    the start, so the first failure is an increase ``rate()`` and alerts can see, not a series
    appearing from nothing.
    """

    def __init__(self, registry: CollectorRegistry, service: str) -> None:
        self.registry = registry
        self._prefix = f"ardit_{service}_"

    def counter(self, name: str, doc: str, labels: Sequence[str] = (), start: Iterable[str] = ()) -> Counter:
        counter = Counter(self._prefix + name, doc, labels, registry=self.registry)
        for value in start:
            counter.labels(value)
        return counter

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(self._prefix + name, doc, registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()) -> Histogram:
        return Histogram(self._prefix + name, doc, labels, buckets=buckets, registry=self.registry)

    def info(self, name: str, doc: str) -> Info:
        return Info(self._prefix + name, doc, registry=self.registry)
