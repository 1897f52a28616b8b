"""README's "Operating ardit" lists, generated from what they describe (so they cannot drift): the metric
families from the metrics classes, the panels from deploy/grafana/build_dashboards.py, the alerts from
deploy/prometheus/rules/.

``python -m tests.readme_operating --write`` rewrites the blocks in README.md between their markers;
tests/test_readme.py fails when the committed README differs from what this generates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from ar_service.metrics import ArMetrics
from dit_service.metrics import DitMetrics
from tests import readme_blocks
from tests.deploy.dashboard import load_builder
from tests.deploy.prometheus_rules import rules

# How a family's samples are named in a scrape, by type.
SCRAPED_NAME = {"counter": "{}_total", "gauge": "{}", "histogram": "{}", "info": "{}_info"}


def families(metrics: object) -> Iterator[MetricWrapperBase]:
    """The metric objects a metrics class holds, nested ones (``AppMetrics``) first, in definition order."""
    members = list(vars(metrics).values())
    for member in members:
        if not isinstance(member, MetricWrapperBase) and hasattr(member, "__dict__"):
            yield from families(member)
    for member in members:
        if isinstance(member, MetricWrapperBase):
            yield member


def metrics_table(metrics: object) -> str:
    rows = ["| family | type | labels | meaning |", "|---|---|---|---|"]
    for family in families(metrics):
        assert family._type is not None, f"{family._name} is a metric class without a type"
        name = SCRAPED_NAME[family._type].format(family._name)
        labels = ", ".join(f"`{label}`" for label in family._labelnames) or "—"
        rows.append(f"| `{name}` | {family._type} | {labels} | {family._documentation} |")
    return "\n".join(rows)


def panels_list() -> str:
    lines = []
    for section in load_builder().SECTIONS:
        lines.append(f"- **{section.title}**")
        lines += [f"  - *{chart.title}* ({chart.kind}): {chart.description}" for chart in section.charts]
    return "\n".join(lines)


def alerts_table() -> str:
    rows = ["| alert | severity | fires when (for) | meaning |", "|---|---|---|---|"]
    for rule in rules("alert"):
        condition = rule["expr"].strip().replace("|", "\\|")
        rows.append(
            f"| `{rule['alert']}` | {rule['labels']['severity']} | `{condition}` ({rule.get('for', '0m')}) "
            f"| {rule['annotations']['description']} |"
        )
    return "\n".join(rows)


def recordings_list() -> str:
    return "\n".join(f"- `{rule['record']}`" for rule in rules("record"))


BLOCKS: dict[str, Callable[[], str]] = {
    "metrics:ar": lambda: metrics_table(ArMetrics(CollectorRegistry())),
    "metrics:dit": lambda: metrics_table(DitMetrics(CollectorRegistry())),
    "panels": panels_list,
    "alerts": alerts_table,
    "recordings": recordings_list,
}


def render(readme: str) -> str:
    return readme_blocks.render(readme, BLOCKS)


if __name__ == "__main__":
    readme_blocks.main(__doc__, BLOCKS)
