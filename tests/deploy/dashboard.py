"""What deploy/grafana's dashboards promise: their PromQL, made runnable on a bare Prometheus the way
Grafana would run it, and the metric families the operations issues asked them to chart."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARDS = GRAFANA / "dashboards"
DASHBOARD = DASHBOARDS / "ardit.json"
DATASOURCE_VARIABLE = {"type": "prometheus", "uid": "${datasource}"}

# As Prometheus stores them: counters end in _total, histograms are charted from _bucket.
CHARTED_FAMILIES = (
    "ardit_ar_http_requests_total",
    "ardit_ar_http_request_seconds_bucket",
    "ardit_ar_api_errors_total",
    "ardit_dit_api_errors_total",
    "ardit_dit_http_request_seconds_bucket",
    "ardit_ar_ready",
    "ardit_dit_ready",
    "ardit_ar_request_seconds_bucket",
    "ardit_ar_time_to_first_token_seconds_bucket",
    "ardit_ar_prompt_tokens_total",
    "ardit_ar_generated_tokens_total",
    "ardit_ar_cached_tokens_total",
    "ardit_ar_cache_creation_tokens_total",
    "ardit_ar_request_cached_tokens_bucket",
    "ardit_ar_queue_wait_seconds_bucket",
    "ardit_ar_handoff_latency_seconds_bucket",
    "ardit_ar_handoff_sent_bytes_total",
    "ardit_ar_handoff_sent_frames_total",
    "ardit_ar_handoff_failures_total",
    "ardit_dit_handoff_received_bytes_total",
    "ardit_dit_handoff_received_frames_total",
    "ardit_dit_handoff_failures_total",
    "ardit_dit_handoff_receive_seconds_bucket",
    "ardit_dit_handoff_buffer_bytes",
    "ardit_dit_handoff_buffer_idle_bytes",
    "ardit_dit_queue_wait_seconds_bucket",
    "ardit_dit_denoise_seconds_bucket",
    "ardit_dit_denoise_step_seconds_bucket",
    "ardit_dit_vae_decode_seconds_bucket",
    "ardit_dit_encode_seconds_bucket",
    "ardit_dit_images_total",
    "ardit_dit_image_pixels_bucket",
    "ardit_dit_pipeline_failures_total",
    "ardit_ar_requests_queued",
    "ardit_ar_requests_in_flight",
    "ardit_ar_handoffs_in_flight",
    "ardit_dit_handoffs_in_flight",
    "ardit_dit_pipeline_runs_in_flight",
    "ardit_dit_pipeline_queue_depth",
    "ardit_dit_pipeline_queue_capacity",
    "ardit_ar_build_info",
    "ardit_dit_build_info",
    "process_resident_memory_bytes",
    "process_cpu_seconds_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:request_prefill_time_seconds_bucket",
    "vllm:request_decode_time_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:num_preemptions_total",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:request_prompt_tokens_bucket",
)
# Exported only when the DiT's pipeline runs on CUDA: charted, but no CPU-only run has them.
CUDA_ONLY_FAMILIES = frozenset({"ardit_dit_gpu_memory_allocated_bytes", "ardit_dit_gpu_memory_reserved_bytes"})

METRIC_NAME = re.compile(r"\b(?:ardit_|vllm:|process_)[a-z0-9_:]+")
VARIABLE = re.compile(r"\$(\w+)")


def load_builder() -> ModuleType:
    path = GRAFANA / "build_dashboards.py"
    spec = importlib.util.spec_from_file_location("build_dashboards", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def load(path: Path = DASHBOARD) -> dict:
    return json.loads(path.read_text())


def charts(dashboard: dict) -> list[dict]:
    """The panels that query (rows only group them)."""
    return [panel for panel in dashboard["panels"] if panel["type"] != "row"]


def targets(dashboard: dict) -> Iterator[tuple[dict, dict]]:
    for panel in charts(dashboard):
        for target in panel["targets"]:
            yield panel, target


def variables(dashboard: dict) -> dict[str, dict]:
    return {variable["name"]: variable for variable in dashboard["templating"]["list"]}


def expressions(dashboard: dict) -> list[str]:
    return [target["expr"] for _, target in targets(dashboard)]


def metric_names(expr: str) -> set[str]:
    return set(METRIC_NAME.findall(expr))


def expand(expr: str, values: dict[str, str]) -> str:
    """``expr`` with Grafana's variables replaced by ``values`` (what Grafana sends Prometheus)."""
    return VARIABLE.sub(lambda match: values[match.group(1)], expr)


def all_values(label_values: Callable[[str, str], list[str]], dashboard: dict, fixed: dict[str, str]) -> dict[str, str]:
    """Every query variable at "All", resolved in order the way Grafana does: its query's values,
    as the regex alternation Grafana puts in a ``=~`` matcher. ``label_values(metric, label)``
    asks Prometheus for the values."""
    values = dict(fixed)
    for name, variable in variables(dashboard).items():
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"])
        assert match, variable["query"]
        found = label_values(expand(match.group(1), values), match.group(2))
        assert found, f"variable {name}: {variable['query']} has no values"
        values[name] = "(" + "|".join(re.escape(value).replace("\\", "\\\\") for value in found) + ")"
    return values
