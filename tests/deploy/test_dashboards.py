"""The Grafana dashboard loads as shipped: the file is what deploy/grafana/build_dashboards.py
generates, every query is on a ``${datasource}`` variable that resolves to the provisioned (default)
Prometheus in compose and is picked on import elsewhere; it charts what the operations issues asked
for, and queries only families the services export."""

from __future__ import annotations

from collections.abc import Iterator

import yaml
from prometheus_client import CollectorRegistry

from ar_service.metrics import ArMetrics
from dit_service.metrics import DitMetrics
from services.connection_guard import ConnectionGuard
from services.metrics import Families
from services.slow_readers import SlowReaders
from tests.deploy.dashboard import (
    CHARTED_FAMILIES,
    CUDA_ONLY_FAMILIES,
    DASHBOARD,
    DASHBOARDS,
    DATASOURCE_VARIABLE,
    ROOT,
    VARIABLE,
    charts,
    expressions,
    load,
    load_builder,
    metric_names,
    targets,
    variables,
)

PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "info": ("_info",),
}
# Grafana's own variables the queries use (expanded by Grafana, by the scrape test for Prometheus).
GRAFANA_BUILTINS = {"__rate_interval", "__range"}


def walk(node, key: str) -> Iterator:
    """Every value stored under ``key`` anywhere in a JSON document."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield v
            yield from walk(v, key)
    elif isinstance(node, list):
        for item in node:
            yield from walk(item, key)


def exported_sample_names() -> set[str]:
    registry = CollectorRegistry()
    ar, dit = ArMetrics(registry), DitMetrics(registry)
    # The AR's public port also has the slow-reader guard's families, and both services the connection guard's.
    SlowReaders(Families(registry, "ar"), send_timeout=1.0, max_responses=1, max_bytes=1)
    for service in ("ar", "dit"):
        ConnectionGuard(Families(registry, service), head_timeout=1.0, max_head_bytes=1024, max_connections=1)
    # The CUDA-only gauges are not registered without CUDA; they are ardit's all the same.
    gpu = {dit.gpu_memory_allocated_bytes, dit.gpu_memory_reserved_bytes}
    assert ar
    families = [*registry.collect(), *(family for gauge in gpu for family in gauge.collect())]
    return {
        family.name + suffix
        for family in families
        if family.name.startswith("ardit_")
        for suffix in SAMPLE_SUFFIXES[family.type]
    }


def grafana_mount(target: str) -> str:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = [v.split(":") for v in compose["services"]["grafana"]["volumes"]]
    (source,) = [source for source, mounted_at, *_ in mounts if mounted_at == target]
    return source


def test_committed_dashboards_are_what_the_builder_generates():
    assert load_builder().main(["--check"]) == 0, "run python deploy/grafana/build_dashboards.py"


def test_every_chart_queries_prometheus_with_distinct_ids():
    dashboard = load()
    assert charts(dashboard)
    for panel in charts(dashboard):
        assert panel["targets"], panel["title"]
        assert all(target["expr"].strip() for target in panel["targets"]), panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert all(ref_ids) and len(ref_ids) == len(set(ref_ids)), panel["title"]
        assert panel["description"], panel["title"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert all(ids) and len(ids) == len(set(ids))


def test_every_query_is_on_the_datasource_variable_a_prometheus_datasource():
    dashboard = load()
    chooser = variables(dashboard)["datasource"]
    assert (chooser["type"], chooser["query"]) == ("datasource", "prometheus")
    references = list(walk(dashboard, "datasource"))
    assert len(references) == len(charts(dashboard)) + sum(
        1 for v in variables(dashboard).values() if v["type"] == "query"
    )
    assert all(reference == DATASOURCE_VARIABLE for reference in references)
    # Importable as it is: no import-time inputs, no datasource of one particular Grafana.
    text = DASHBOARD.read_text()
    assert "__inputs" not in text and "${DS_" not in text


def test_queries_use_only_defined_variables_and_every_instance_variable_filters():
    dashboard = load()
    defined = set(variables(dashboard)) | GRAFANA_BUILTINS
    used = {name for expr in expressions(dashboard) for name in VARIABLE.findall(expr)}
    used |= {name for v in variables(dashboard).values() for name in VARIABLE.findall(str(v.get("query", "")))}
    assert used <= defined
    assert {"ar_instance", "dit_instance", "model"} <= used
    for variable in variables(dashboard).values():
        if variable["type"] == "query":
            assert variable["multi"] and variable["includeAll"] and variable["current"]["value"] == ["$__all"]


def test_charts_every_family_the_issues_ask_for():
    queried = set().union(*(metric_names(expr) for expr in expressions(load())))
    assert set(CHARTED_FAMILIES) <= queried
    assert queried >= CUDA_ONLY_FAMILIES


def test_queries_only_families_the_services_export():
    queried = set().union(*(metric_names(expr) for expr in expressions(load())))
    ardit = {name for name in queried if name.startswith("ardit_")}
    assert ardit <= exported_sample_names()


def test_stats_are_instant_and_heatmaps_read_buckets():
    for panel, target in targets(load()):
        if panel["type"] in ("stat", "table"):
            assert target["instant"] is True, panel["title"]
        if panel["type"] == "heatmap":
            assert target["format"] == "heatmap" and "_bucket{" in target["expr"], panel["title"]


def test_the_provisioned_prometheus_is_the_default_datasource_the_variable_resolves_to():
    config = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    (datasource,) = config["datasources"]
    assert datasource["type"] == DATASOURCE_VARIABLE["type"] and datasource["isDefault"] is True
    assert datasource["url"] == "http://prometheus:9090"


def test_dashboard_provider_reads_where_compose_mounts_the_dashboards():
    config = yaml.safe_load((PROVISIONING / "dashboards" / "ardit.yml").read_text())
    (provider,) = config["providers"]
    assert provider["type"] == "file"
    assert (ROOT / grafana_mount(provider["options"]["path"])).resolve() == DASHBOARDS
    assert (ROOT / grafana_mount("/etc/grafana/provisioning")).resolve() == PROVISIONING
    assert [path.name for path in DASHBOARDS.iterdir()] == ["ardit.json"]
