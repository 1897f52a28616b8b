"""The "ardit" Grafana dashboard, written in code with Grafana's own grafana-foundation-sdk.

One file comes out of it, ``dashboards/ardit.json``: every query on a ``${datasource}`` variable
(a Prometheus datasource, the default one unless chosen), so the same file is what docker-compose's
Grafana provisions (its Prometheus is the default datasource) and what any other Grafana imports
(Dashboards → New → Import). It has ``ar_instance``, ``dit_instance`` and ``model`` variables too
(every instance by default). Why code and not hand-edited JSON: some forty panels; the SDK's builders
are generated from Grafana's own schema for the Grafana version compose runs (11.6), so a panel option
that does not exist does not type-check, and a layout is computed, not typed.

    python deploy/grafana/build_dashboards.py          # rewrite the file
    python deploy/grafana/build_dashboards.py --check  # exit 1 if the committed file is stale

tests/deploy/test_dashboards.py runs the check; tests/deploy/test_prometheus_scrape.py evaluates
every query against a real Prometheus that scraped the running pair.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders.common import ReduceDataOptions
from grafana_foundation_sdk.builders.dashboard import Dashboard as DashboardBuilder
from grafana_foundation_sdk.builders.dashboard import (
    DatasourceVariable,
    QueryVariable,
    Row,
    ThresholdsConfig,
)
from grafana_foundation_sdk.builders.heatmap import Panel as HeatmapPanel
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.stat import Panel as StatPanel
from grafana_foundation_sdk.builders.table import Panel as TablePanel
from grafana_foundation_sdk.builders.timeseries import Panel as TimeseriesPanel
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    Panel,
    Threshold,
    ThresholdsMode,
    VariableOption,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

GRAFANA = Path(__file__).resolve().parent
DASHBOARD = GRAFANA / "dashboards" / "ardit.json"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")

# Label selectors of each source, narrowed by the dashboard's variables.
AR = 'instance=~"$ar_instance"'
DIT = 'instance=~"$dit_instance"'
VLLM = 'instance=~"$ar_instance", model_name=~"$model"'
RATE = "$__rate_interval"
RANGE = "$__range"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Chart:
    """One panel: what it shows (``description`` is also its line in docs/operating.md)."""

    title: str
    description: str
    kind: str  # timeseries, stat, heatmap, table
    unit: str
    queries: tuple[Query, ...]
    width: int = 12


@dataclass(frozen=True)
class Section:
    title: str
    charts: tuple[Chart, ...]


def quantiles(histogram: str, selector: str, window: str = RATE) -> tuple[Query, ...]:
    """p50, p95 and p99 of a histogram: per step (``rate``), or over the range (``increase``, for stats)."""
    fn = "rate" if window == RATE else "increase"
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by (le) ({fn}({histogram}_bucket{{{selector}}}[{window}])))",
            f"p{round(q * 100)}",
        )
        for q in (0.5, 0.95, 0.99)
    )


def p50_p99(histogram: str, selector: str, label: str) -> tuple[Query, ...]:
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{{{selector}}}[{RATE}])))",
            f"{label} p{round(q * 100)}",
        )
        for q in (0.5, 0.99)
    )


def series(title: str, description: str, unit: str, *queries: Query, width: int = 12) -> Chart:
    return Chart(title, description, "timeseries", unit, queries, width)


def stat(title: str, description: str, unit: str, *queries: Query, width: int = 6) -> Chart:
    return Chart(title, description, "stat", unit, queries, width)


def heatmap(title: str, description: str, unit: str, histogram: str, selector: str) -> Chart:
    query = Query(f"sum by (le) (increase({histogram}_bucket{{{selector}}}[{RATE}]))", "{{le}}")
    return Chart(title, description, "heatmap", unit, (query,))


SECTIONS = (
    Section(
        "Service level",
        (
            stat(
                "Time to first token",
                "p50/p95/p99 over the dashboard's time range: HTTP request received to first generated token.",
                "s",
                *quantiles("ardit_ar_time_to_first_token_seconds", AR, RANGE),
            ),
            stat(
                "Handoff latency",
                "p50/p95/p99 over the range: the AR's last row to the DiT holding the complete conditioning.",
                "s",
                *quantiles("ardit_ar_handoff_latency_seconds", AR, RANGE),
            ),
            stat(
                "End-to-end latency",
                "p50/p95/p99 over the range: image request received to answered.",
                "s",
                *quantiles("ardit_ar_request_seconds", AR, RANGE),
            ),
            stat(
                "Images",
                "Final images rendered over the range.",
                "short",
                Query(f"sum(increase(ardit_dit_images_total{{{DIT}}}[{RANGE}]))", "images"),
                width=3,
            ),
            stat(
                "Server errors",
                "Over the range: 5xx error bodies (JSON and stream events) over public API responses.",
                "percentunit",
                Query(
                    f'(sum(increase(ardit_ar_api_errors_total{{{AR}, status=~"5.."}}[{RANGE}])) or vector(0))'
                    f' / sum(increase(ardit_ar_http_requests_total{{{AR}, route=~"/v1/.*"}}[{RANGE}]))',
                    "5xx share",
                ),
                width=3,
            ),
            series(
                "Time to first token",
                "p50/p95/p99 per step.",
                "s",
                *quantiles("ardit_ar_time_to_first_token_seconds", AR),
            ),
            series("Handoff latency", "p50/p95/p99 per step.", "s", *quantiles("ardit_ar_handoff_latency_seconds", AR)),
            series("End-to-end latency", "p50/p95/p99 per step.", "s", *quantiles("ardit_ar_request_seconds", AR)),
            series(
                "Images/s by format",
                "Final images rendered per second, by output format.",
                "short",
                Query(f"sum by (format) (rate(ardit_dit_images_total{{{DIT}}}[{RATE}]))", "{{format}}"),
            ),
            series(
                "AR responses/s by route and status",
                "Every HTTP response of the AR, also those refused before a route handler (route none: no route).",
                "reqps",
                Query(
                    f"sum by (route, status) (rate(ardit_ar_http_requests_total{{{AR}}}[{RATE}]))",
                    "{{route}} {{status}}",
                ),
            ),
            series(
                "Errors/s by status and code",
                "OpenAI-shaped error bodies sent by each service, by HTTP status and error code.",
                "reqps",
                Query(
                    f"sum by (status, code) (rate(ardit_ar_api_errors_total{{{AR}}}[{RATE}]))",
                    "AR {{status}} {{code}}",
                ),
                Query(
                    f"sum by (status, code) (rate(ardit_dit_api_errors_total{{{DIT}}}[{RATE}]))",
                    "DiT {{status}} {{code}}",
                ),
            ),
        ),
    ),
    Section(
        "vLLM engine",
        (
            series(
                "Scheduler: running and waiting",
                "Requests vLLM's scheduler runs and holds waiting.",
                "short",
                Query(f"sum(vllm:num_requests_running{{{VLLM}}})", "running"),
                Query(f"sum(vllm:num_requests_waiting{{{VLLM}}})", "waiting"),
            ),
            series(
                "Engine queue time",
                "Time requests waited in vLLM's scheduler queue.",
                "s",
                *p50_p99("vllm:request_queue_time_seconds", VLLM, "queue"),
            ),
            series(
                "Prefill and decode time",
                "Per request, vLLM's prefill phase and decode phase.",
                "s",
                *p50_p99("vllm:request_prefill_time_seconds", VLLM, "prefill"),
                *p50_p99("vllm:request_decode_time_seconds", VLLM, "decode"),
            ),
            series(
                "Inter-token latency",
                "Time between generated tokens (requests that generate more than one).",
                "s",
                *quantiles("vllm:inter_token_latency_seconds", VLLM),
            ),
            series(
                "Preemptions/s",
                "Requests vLLM preempted for lack of KV-cache blocks.",
                "short",
                Query(f"sum(rate(vllm:num_preemptions_total{{{VLLM}}}[{RATE}]))", "preemptions"),
            ),
            series(
                "KV-cache usage",
                "Share of KV-cache blocks in use (hidden rows live there too).",
                "percentunit",
                Query(f"max by (instance) (vllm:kv_cache_usage_perc{{{VLLM}}})", "{{instance}}"),
            ),
            series(
                "Prefix-cache hit rate",
                "Cached prompt tokens over prompt tokens (ardit's count, both streams) and vLLM's hits over queries.",
                "percentunit",
                Query(
                    f"sum(rate(ardit_ar_cached_tokens_total{{{AR}}}[{RATE}]))"
                    f" / sum(rate(ardit_ar_prompt_tokens_total{{{AR}}}[{RATE}]))",
                    "ardit",
                ),
                Query(
                    f"sum(rate(vllm:prefix_cache_hits_total{{{VLLM}}}[{RATE}]))"
                    f" / sum(rate(vllm:prefix_cache_queries_total{{{VLLM}}}[{RATE}]))",
                    "vLLM",
                ),
            ),
            series(
                "Tokens/s",
                "Prompt tokens (cached and cache-creating among them) and generated tokens.",
                "short",
                Query(f"sum(rate(ardit_ar_prompt_tokens_total{{{AR}}}[{RATE}]))", "prompt"),
                Query(f"sum(rate(ardit_ar_cached_tokens_total{{{AR}}}[{RATE}]))", "cached"),
                Query(f"sum(rate(ardit_ar_cache_creation_tokens_total{{{AR}}}[{RATE}]))", "cache creation"),
                Query(f"sum(rate(ardit_ar_generated_tokens_total{{{AR}}}[{RATE}]))", "generated"),
            ),
            heatmap(
                "Prompt length",
                "Prompt tokens per engine request (vLLM).",
                "short",
                "vllm:request_prompt_tokens",
                VLLM,
            ),
            heatmap(
                "Cached tokens per request",
                "Prompt tokens served from the prefix cache, per image request (both streams).",
                "short",
                "ardit_ar_request_cached_tokens",
                AR,
            ),
        ),
    ),
    Section(
        "Handoff",
        (
            series(
                "Handoff throughput",
                "Handoff bytes per second sent by the AR and received by the DiT.",
                "Bps",
                Query(f"sum(rate(ardit_ar_handoff_sent_bytes_total{{{AR}}}[{RATE}]))", "sent"),
                Query(f"sum(rate(ardit_dit_handoff_received_bytes_total{{{DIT}}}[{RATE}]))", "received"),
            ),
            series(
                "Handoff frames/s",
                "Frames per second sent by the AR and parsed by the DiT.",
                "short",
                Query(f"sum(rate(ardit_ar_handoff_sent_frames_total{{{AR}}}[{RATE}]))", "sent"),
                Query(f"sum(rate(ardit_dit_handoff_received_frames_total{{{DIT}}}[{RATE}]))", "received"),
            ),
            series(
                "Failures/s by reason",
                "Handoffs that failed (AR and DiT side) and pipeline runs that did not finish, by reason.",
                "short",
                Query(f"sum by (reason) (rate(ardit_ar_handoff_failures_total{{{AR}}}[{RATE}]))", "AR {{reason}}"),
                Query(f"sum by (reason) (rate(ardit_dit_handoff_failures_total{{{DIT}}}[{RATE}]))", "DiT {{reason}}"),
                Query(
                    f"sum by (reason) (rate(ardit_dit_pipeline_failures_total{{{DIT}}}[{RATE}]))",
                    "pipeline {{reason}}",
                ),
            ),
            series(
                "DiT handoff receive time",
                "From a handoff's first byte to its accepted close, on the DiT.",
                "s",
                *p50_p99("ardit_dit_handoff_receive_seconds", DIT, "receive"),
            ),
        ),
    ),
    Section(
        "DiT",
        (
            series(
                "DiT stage times",
                "p50 and p99 of the wait for a pipeline slot, denoising, VAE decode and image encoding, per image.",
                "s",
                *p50_p99("ardit_dit_queue_wait_seconds", DIT, "queue"),
                *p50_p99("ardit_dit_denoise_seconds", DIT, "denoise"),
                *p50_p99("ardit_dit_vae_decode_seconds", DIT, "VAE decode"),
                *p50_p99("ardit_dit_encode_seconds", DIT, "encode"),
            ),
            series(
                "Denoise step time",
                "One denoising step (an image's first step includes the pipeline's set-up).",
                "s",
                *p50_p99("ardit_dit_denoise_step_seconds", DIT, "step"),
            ),
            series(
                "Step cache",
                "Transformer passes of runs with a step cache, per second, by method: computed in full, or reused "
                "(the hook skipped or extrapolated the blocks); the reused share is the cache's saving.",
                "ops",
                Query(
                    f"sum by (method, outcome) (rate(ardit_dit_step_cache_passes_total{{{DIT}}}[{RATE}]))",
                    "{{method}} {{outcome}}",
                ),
            ),
            heatmap(
                "Image sizes",
                "Final images by size in pixels (width x height).",
                "short",
                "ardit_dit_image_pixels",
                DIT,
            ),
            series(
                "DiT memory",
                "Row buffers held by handoffs and kept warm for reuse, and the process's resident memory.",
                "bytes",
                Query(f"sum(ardit_dit_handoff_buffer_bytes{{{DIT}}})", "row buffers"),
                Query(f"sum(ardit_dit_handoff_buffer_idle_bytes{{{DIT}}})", "idle row buffers"),
                Query(f"sum(process_resident_memory_bytes{{{DIT}}})", "resident"),
            ),
            series(
                "DiT GPU memory",
                "Memory of the pipeline's tensors and PyTorch's reserved pool (CUDA only; empty on CPU).",
                "bytes",
                Query(f"sum by (instance) (ardit_dit_gpu_memory_allocated_bytes{{{DIT}}})", "allocated {{instance}}"),
                Query(f"sum by (instance) (ardit_dit_gpu_memory_reserved_bytes{{{DIT}}})", "reserved {{instance}}"),
            ),
        ),
    ),
    Section(
        "Queues and in flight",
        (
            series(
                "AR: in flight and queued",
                "Image requests being served and waiting for admission, and handoffs being streamed.",
                "short",
                Query(f"sum(ardit_ar_requests_in_flight{{{AR}}})", "in flight"),
                Query(f"sum(ardit_ar_requests_queued{{{AR}}})", "queued"),
                Query(f"sum(ardit_ar_handoffs_in_flight{{{AR}}})", "handoffs"),
            ),
            series(
                "AR admission wait",
                "Time requests waited for admission, and the pace admission prices waits at, measured between "
                "completions: seconds a request, a megapixel of images, and a unit of denoising (an image's step at "
                "a megapixel, twice with CFG).",
                "s",
                *p50_p99("ardit_ar_queue_wait_seconds", AR, "wait"),
                Query(f"max(ardit_ar_admission_seconds_per_request{{{AR}}})", "seconds a request"),
                Query(f"max(ardit_ar_admission_seconds_per_megapixel{{{AR}}})", "seconds a megapixel"),
                Query(f"max(ardit_ar_admission_seconds_per_work{{{AR}}})", "seconds a unit of denoising"),
            ),
            series(
                "AR: clients that stopped reading",
                "Answers waiting on clients that stopped reading (their capacity is already free), and the "
                "connections cut off per second (send timeout, or over the bound on answers waiting).",
                "short",
                Query(f"sum(ardit_ar_slow_readers{{{AR}}})", "waiting"),
                Query(f"sum by (reason) (rate(ardit_ar_slow_readers_closed_total{{{AR}}}[5m]))", "cut off: {{reason}}"),
            ),
            series(
                "Connections",
                "Open client connections on each service, and those closed before a request per second (no complete "
                "head in time, a head over the cap, or closed to make room at the connection cap).",
                "short",
                Query(f"sum(ardit_ar_connections_open{{{AR}}})", "AR open"),
                Query(f"sum(ardit_dit_connections_open{{{DIT}}})", "DiT open"),
                Query(
                    f"sum by (reason) (rate(ardit_ar_connections_closed_total{{{AR}}}[5m]))", "AR closed: {{reason}}"
                ),
                Query(
                    f"sum by (reason) (rate(ardit_dit_connections_closed_total{{{DIT}}}[5m]))", "DiT closed: {{reason}}"
                ),
            ),
            series(
                "DiT: in flight and queued",
                "Handoffs being received, pipeline runs executing, completed handoffs waiting for a run (of capacity).",
                "short",
                Query(f"sum(ardit_dit_handoffs_in_flight{{{DIT}}})", "receiving"),
                Query(f"sum(ardit_dit_pipeline_runs_in_flight{{{DIT}}})", "running"),
                Query(f"sum(ardit_dit_pipeline_queue_depth{{{DIT}}})", "queued"),
                Query(f"sum(ardit_dit_pipeline_queue_capacity{{{DIT}}})", "queue capacity"),
            ),
            series(
                "HTTP time p99 by route",
                "p99 of request to last response byte, by route, on each service.",
                "s",
                Query(
                    "histogram_quantile(0.99, sum by (le, route) "
                    f"(rate(ardit_ar_http_request_seconds_bucket{{{AR}}}[{RATE}])))",
                    "AR {{route}}",
                ),
                Query(
                    "histogram_quantile(0.99, sum by (le, route) "
                    f"(rate(ardit_dit_http_request_seconds_bucket{{{DIT}}}[{RATE}])))",
                    "DiT {{route}}",
                ),
            ),
        ),
    ),
    Section(
        "Processes and scrapes",
        (
            stat(
                "Scrape health",
                "1 when Prometheus's last scrape of the instance succeeded, 0 when it failed.",
                "short",
                Query(f"up{{{AR}}}", "{{instance}}"),
                Query(f"up{{{DIT}}}", "{{instance}}"),
            ),
            stat(
                "Ready",
                "1 when the instance's /readyz answers ready (engine warmed and DiT reachable; pipeline warmed).",
                "short",
                Query(f"ardit_ar_ready{{{AR}}}", "AR {{instance}}"),
                Query(f"ardit_dit_ready{{{DIT}}}", "DiT {{instance}}"),
            ),
            series(
                "Scrape duration",
                "How long each scrape took (vLLM's families make the AR's larger).",
                "s",
                Query(f"scrape_duration_seconds{{{AR}}}", "AR {{instance}}"),
                Query(f"scrape_duration_seconds{{{DIT}}}", "DiT {{instance}}"),
            ),
            series(
                "Resident memory",
                "Resident set size of each service's process.",
                "bytes",
                Query(f"process_resident_memory_bytes{{{AR}}}", "AR {{instance}}"),
                Query(f"process_resident_memory_bytes{{{DIT}}}", "DiT {{instance}}"),
            ),
            series(
                "CPU",
                "CPU seconds per second used by each service's process (vLLM's engine process not included).",
                "short",
                Query(f"rate(process_cpu_seconds_total{{{AR}}}[{RATE}])", "AR {{instance}}"),
                Query(f"rate(process_cpu_seconds_total{{{DIT}}}[{RATE}])", "DiT {{instance}}"),
            ),
            Chart(
                "Build info",
                "Version, model, dtype and device of every instance.",
                "table",
                "short",
                (
                    Query(f"ardit_ar_build_info{{{AR}}}", "AR"),
                    Query(f"ardit_dit_build_info{{{DIT}}}", "DiT"),
                ),
                width=24,
            ),
        ),
    ),
)


def _target(query: Query, ref_id: str, kind: str) -> Dataquery:
    target = Dataquery().expr(query.expr).legend_format(query.legend).ref_id(ref_id)
    if kind in ("stat", "table"):
        target = target.instant()
    if kind == "table":
        target = target.format(PromQueryFormat.TABLE)
    if kind == "heatmap":
        target = target.format(PromQueryFormat.HEATMAP)
    return target


def _panel(chart: Chart, panel_id: int, datasource: DataSourceRef) -> Builder[Panel]:
    panel_builders: dict[str, type[TimeseriesPanel | StatPanel | HeatmapPanel | TablePanel]] = {
        "timeseries": TimeseriesPanel,
        "stat": StatPanel,
        "heatmap": HeatmapPanel,
        "table": TablePanel,
    }
    builder = panel_builders[chart.kind]()
    builder = builder.id(panel_id).title(chart.title).description(chart.description).datasource(datasource)
    builder = builder.unit(chart.unit).span(chart.width).height(8 if chart.kind != "stat" else 5)
    for index, query in enumerate(chart.queries):
        builder = builder.with_target(_target(query, chr(ord("A") + index), chart.kind))
    if isinstance(builder, StatPanel):
        builder = builder.reduce_options(ReduceDataOptions().calcs(["lastNotNull"]))
    if chart.title in ("Scrape health", "Ready"):
        builder = builder.thresholds(
            ThresholdsConfig()
            .mode(ThresholdsMode.ABSOLUTE)
            .steps([Threshold(value=None, color="red"), Threshold(value=1, color="green")])
        )
    if isinstance(builder, HeatmapPanel):
        builder = builder.calculate(False)
    return builder


def _instances(name: str, label: str, family: str, datasource: DataSourceRef) -> QueryVariable:
    return (
        QueryVariable(name)
        .label(label)
        .datasource(datasource)
        .query(family)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .current(VariableOption(selected=True, text=["All"], value=["$__all"]))
    )


def build() -> DashboardBuilder:
    """The dashboard, every query on the ``datasource`` variable."""
    datasource = DATASOURCE
    dashboard = (
        DashboardBuilder("ardit")
        .uid("ardit-overview")
        .description("AR (vLLM) → DiT (diffusers) image service: SLIs, vLLM engine, handoff, DiT, queues, processes.")
        .tags(["ardit", "vllm"])
        .timezone("browser")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .refresh("10s")
        .time("now-30m", "now")
        .readonly()
        .with_variable(DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
    )
    dashboard = (
        dashboard.with_variable(
            _instances("ar_instance", "AR instance", "label_values(ardit_ar_build_info, instance)", datasource)
        )
        .with_variable(
            _instances("dit_instance", "DiT instance", "label_values(ardit_dit_build_info, instance)", datasource)
        )
        .with_variable(
            _instances(
                "model",
                "vLLM model",
                'label_values(vllm:num_requests_running{instance=~"$ar_instance"}, model_name)',
                datasource,
            )
        )
    )
    panel_id = 0
    for section in SECTIONS:
        panel_id += 1
        dashboard = dashboard.with_row(Row(section.title).id(panel_id))
        for chart in section.charts:
            panel_id += 1
            dashboard = dashboard.with_panel(_panel(chart, panel_id, datasource))
    return dashboard


def render() -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(build().build()) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed dashboard differs")
    args = parser.parse_args(argv)
    if args.check:
        stale = not DASHBOARD.exists() or DASHBOARD.read_text() != render()
        if stale:
            print(f"{DASHBOARD} is stale: run python {Path(__file__).relative_to(GRAFANA.parents[1])}", file=sys.stderr)
        return 1 if stale else 0
    DASHBOARD.write_text(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
