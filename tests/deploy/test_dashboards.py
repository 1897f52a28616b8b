"""The Grafana dashboard and provisioning load as shipped: the dashboard names the provisioned
datasource by its pinned uid (no import step), charts what the operations issue asked for, and
queries only families the services export."""

from __future__ import annotations

from collections.abc import Iterator

import yaml
from prometheus_client import CollectorRegistry

from ar_service.metrics import ArMetrics
from dit_service.metrics import DitMetrics
from tests.deploy.dashboard import (
    CHARTED_FAMILIES,
    DASHBOARDS,
    DATASOURCE,
    ROOT,
    expressions,
    load,
    metric_names,
    targets,
)

PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "info": ("_info",),
}


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
    ArMetrics(registry)
    DitMetrics(registry)
    return {
        family.name + suffix
        for family in registry.collect()
        if family.name.startswith("ardit_")
        for suffix in SAMPLE_SUFFIXES[family.type]
    }


def grafana_mount(target: str) -> str:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = [v.split(":") for v in compose["services"]["grafana"]["volumes"]]
    (source,) = [source for source, mounted_at, *_ in mounts if mounted_at == target]
    return source


def test_every_panel_queries_prometheus():
    dashboard = load()
    assert dashboard["panels"]
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        assert all(target["expr"].strip() for target in panel["targets"]), panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_every_datasource_is_the_pinned_uid():
    dashboard = load()
    references = list(walk(dashboard, "datasource"))
    assert len(references) == len(dashboard["panels"]) + sum(1 for _ in targets(dashboard))
    assert all(reference == DATASOURCE for reference in references)


def test_no_import_placeholders():
    text = (DASHBOARDS / "ardit.json").read_text()
    assert "__inputs" not in text and "${DS_" not in text


def test_uses_only_grafana_variables_the_scrape_test_can_expand():
    assert not any("$" in expr for expr in expressions(load()))


def test_charts_every_family_the_issue_asks_for():
    queried = set().union(*(metric_names(expr) for expr in expressions(load())))
    assert set(CHARTED_FAMILIES) <= queried


def test_queries_only_families_the_services_export():
    queried = set().union(*(metric_names(expr) for expr in expressions(load())))
    ardit = {name for name in queried if name.startswith("ardit_")}
    assert ardit <= exported_sample_names()


def test_provisioned_datasource_is_the_one_the_dashboard_uses():
    config = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    (datasource,) = config["datasources"]
    assert {"type": datasource["type"], "uid": datasource["uid"]} == DATASOURCE
    assert datasource["url"] == "http://prometheus:9090"


def test_dashboard_provider_reads_where_compose_mounts_the_dashboards():
    config = yaml.safe_load((PROVISIONING / "dashboards" / "ardit.yml").read_text())
    (provider,) = config["providers"]
    assert provider["type"] == "file"
    assert (ROOT / grafana_mount(provider["options"]["path"])).resolve() == DASHBOARDS
    assert (ROOT / grafana_mount("/etc/grafana/provisioning")).resolve() == PROVISIONING
