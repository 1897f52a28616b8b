"""README's "Operating ardit" lists, generated from what they describe (so they cannot drift): the metric
families from the metrics classes, the panels from deploy/grafana/build_dashboards.py, the alerts from
deploy/prometheus/rules/.

``python -m tests.readme_operating --write`` rewrites the blocks in README.md between their markers;
tests/test_readme.py fails when the committed README differs from what this generates.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from ar_service.metrics import ArMetrics
from dit_service.metrics import DitMetrics
from tests.deploy.dashboard import load_builder
from tests.deploy.prometheus_rules import rules
from tests.readme_settings import README

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
    for key, block in BLOCKS.items():
        begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
        pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
        if not pattern.search(readme):
            raise ValueError(f"README.md has no {begin} ... {end} block")
        text = f"{begin}\n{block()}\n{end}"
        readme = pattern.sub(lambda _, text=text: text, readme)
    return readme


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite README.md's blocks in place")
    args = parser.parse_args()
    text = README.read_text()
    if args.write:
        README.write_text(render(text))
    else:
        print(render(text))
