"""What deploy/grafana/dashboards/ardit.json promises: its PromQL, made runnable on a bare
Prometheus, and the metric families the operations issue asked it to chart."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "ardit-prometheus"}

# As Prometheus stores them: counters end in _total, histograms are charted from _bucket.
CHARTED_FAMILIES = (
    "ardit_ar_requests_total",
    "ardit_ar_request_seconds_bucket",
    "ardit_ar_time_to_first_token_seconds_bucket",
    "ardit_ar_prompt_tokens_total",
    "ardit_ar_cached_tokens_total",
    "ardit_ar_cache_creation_tokens_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "ardit_handoff_latency_seconds_bucket",
    "ardit_handoff_bytes_sent_total",
    "ardit_dit_handoff_bytes_received_total",
    "ardit_dit_queue_wait_seconds_bucket",
    "ardit_dit_denoise_seconds_bucket",
    "ardit_dit_vae_decode_seconds_bucket",
    "ardit_dit_encode_seconds_bucket",
    "ardit_ar_requests_queued",
    "ardit_ar_requests_in_flight",
    "ardit_handoffs_in_flight",
    "ardit_dit_handoffs_in_flight",
    "ardit_dit_pipeline_runs_in_flight",
    "vllm:kv_cache_usage_perc",
)

# Grafana expands these before a query reaches Prometheus; a bare Prometheus needs a value.
GRAFANA_VARIABLES = {"$__rate_interval": "1m"}

METRIC_NAME = re.compile(r"\b(?:ardit_|vllm:)[a-z0-9_:]+")


def load() -> dict:
    return json.loads((DASHBOARDS / "ardit.json").read_text())


def targets(dashboard: dict) -> Iterator[tuple[dict, dict]]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel, target


def promql(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def expressions(dashboard: dict) -> list[str]:
    return [promql(target["expr"]) for _, target in targets(dashboard)]


def metric_names(expr: str) -> set[str]:
    return set(METRIC_NAME.findall(expr))
