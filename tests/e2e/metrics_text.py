"""Read one sample from a service's /metrics (Prometheus text format)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def sample(base_url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(f"{name} {labels} not in {base_url}/metrics")
