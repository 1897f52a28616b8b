"""Read one sample from a service's /metrics (Prometheus text format), as the operator: with API keys on,
the AR's public /metrics takes the admin token."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ADMIN_TOKEN


def sample(base_url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{base_url}/metrics", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(f"{name} {labels} not in {base_url}/metrics")
