"""The generated tables of docs/: written from what they describe, so they cannot drift.

Each block sits in a docs page between ``<!-- KEY:begin -->`` and ``<!-- KEY:end -->``: the request
fields (from the public request models' ``Field(description=...)``), the settings (from the settings
classes), the metric families (from the metrics classes), the dashboard's panels (from
deploy/grafana/build_dashboards.py) and the alert and recording rules (from deploy/prometheus/rules/).

    python docs/build_tables.py --write   # rewrite the blocks in place
    python docs/build_tables.py --check   # exit 1 if any page differs from what this generates (a test runs it)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from openai.types.image_edit_params import ImageEditParamsStreaming
from openai.types.image_generate_params import ImageGenerateParamsStreaming
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

from ar_service.api.protocol import ImageEditRequest, ImageGenerationRequest, ImageRequest
from ar_service.metrics import ArMetrics
from ar_service.settings import ArSettings
from dit_service.metrics import DitMetrics
from dit_service.settings import DitSettings
from services.connection_guard import ConnectionGuard
from services.metrics import Families
from services.slow_readers import SlowReaders

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# How a family's samples are named in a scrape, by type.
SCRAPED_NAME = {"counter": "{}_total", "gauge": "{}", "histogram": "{}", "info": "{}_info"}


# --- request fields --------------------------------------------------------------------------------


def request_table(model: type[BaseModel], openai_fields: set[str], only: set[str] | None = None) -> str:
    rows = ["| field | here |", "|---|---|"]
    for name, field in model.model_fields.items():
        if only is not None and name not in only:
            continue
        mark = "" if name in openai_fields else " *(ardit)*"
        rows.append(f"| `{name}`{mark} | {field.description or ''} |")
    return "\n".join(rows)


def openai_fields(params: type) -> set[str]:
    """The fields of one of the openai package's request types (the streaming one has them all)."""
    return {name for kind in params.__mro__ for name in getattr(kind, "__annotations__", {})}


def generation_fields() -> str:
    return request_table(ImageGenerationRequest, openai_fields(ImageGenerateParamsStreaming))


def edit_fields() -> str:
    edit_only = set(ImageEditRequest.model_fields) - set(ImageRequest.model_fields)
    return request_table(ImageEditRequest, openai_fields(ImageEditParamsStreaming), only=edit_only)


# --- settings --------------------------------------------------------------------------------------


def env_name(settings: type[BaseSettings], name: str, field: FieldInfo) -> str:
    alias = field.validation_alias
    return alias if isinstance(alias, str) else f"{settings.model_config['env_prefix']}{name.upper()}"


def default_text(field: FieldInfo) -> str:
    value: Any = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    if isinstance(value, Path):
        return f"`$ARDIT_CACHE_DIR/models/{value.name}`"
    if value is None or value is PydanticUndefined:
        return "—"
    if isinstance(value, list | frozenset | set) and not value:
        return "[]"
    text = str(value).replace("\n", "\\n").replace("|", "\\|")
    return f"`{text}`" if len(text) <= 40 else f"`{text[:37]}...`"


def settings_table(settings: type[BaseSettings]) -> str:
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, field in settings.model_fields.items():
        rows.append(f"| `{env_name(settings, name, field)}` | {default_text(field)} | {field.description or ''} |")
    return "\n".join(rows)


# --- operating -------------------------------------------------------------------------------------


def families(metrics: object) -> Iterator[MetricWrapperBase]:
    """The metric objects a metrics class holds, nested ones (``AppMetrics``) first, in definition order."""
    members = list(vars(metrics).values())
    for member in members:
        if not isinstance(member, MetricWrapperBase) and hasattr(member, "__dict__"):
            yield from families(member)
    for member in members:
        if isinstance(member, MetricWrapperBase):
            yield member


def metrics_table(*holders: object) -> str:
    rows = ["| family | type | labels | meaning |", "|---|---|---|---|"]
    for family in (family for holder in holders for family in families(holder)):
        kind = family._type
        if kind is None:
            raise ValueError(f"{family._name} is a metric class without a type")
        labels = ", ".join(f"`{label}`" for label in family._labelnames) or "—"
        rows.append(f"| `{SCRAPED_NAME[kind].format(family._name)}` | {kind} | {labels} | {family._documentation} |")
    return "\n".join(rows)


def ar_metrics_table() -> str:
    """The AR's own families, then the slow-reader guard's (its public port has one; the DiT's has not) and the
    connection guard's."""
    registry = CollectorRegistry()
    guard = SlowReaders(Families(registry, "ar"), send_timeout=1.0, max_responses=1, max_bytes=1)
    return metrics_table(ArMetrics(registry), guard, connection_guard(registry, "ar"))


def dit_metrics_table() -> str:
    registry = CollectorRegistry()
    return metrics_table(DitMetrics(registry), connection_guard(registry, "dit"))


def connection_guard(registry: CollectorRegistry, service: str) -> ConnectionGuard:
    return ConnectionGuard(Families(registry, service), head_timeout=1.0, max_head_bytes=1024, max_connections=1)


def dashboard_builder() -> Any:
    path = ROOT / "deploy" / "grafana" / "build_dashboards.py"
    spec = importlib.util.spec_from_file_location("build_dashboards", path)
    if spec is None or spec.loader is None:
        raise ImportError(path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def panels_list() -> str:
    lines = []
    for section in dashboard_builder().SECTIONS:
        lines.append(f"- **{section.title}**")
        lines += [f"  - *{chart.title}* ({chart.kind}): {chart.description}" for chart in section.charts]
    return "\n".join(lines)


def rules(kind: str) -> list[dict[str, Any]]:
    """Every rule of ``kind`` (``record`` or ``alert``), in file order."""
    files = sorted((ROOT / "deploy" / "prometheus" / "rules").glob("*.yml"))
    groups = [group for path in files for group in yaml.safe_load(path.read_text())["groups"]]
    return [rule for group in groups for rule in group["rules"] if kind in rule]


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


# Each page and the blocks it holds.
PAGES: dict[str, dict[str, Callable[[], str]]] = {
    "api.md": {"request:generations": generation_fields, "request:edits": edit_fields},
    "settings.md": {
        "settings:ar": lambda: settings_table(ArSettings),
        "settings:dit": lambda: settings_table(DitSettings),
    },
    "operating.md": {
        "metrics:ar": ar_metrics_table,
        "metrics:dit": dit_metrics_table,
        "panels": panels_list,
        "alerts": alerts_table,
        "recordings": recordings_list,
    },
}


def render(text: str, blocks: dict[str, Callable[[], str]]) -> str:
    """``text`` with each block's content replaced by what its generator returns now."""
    for key, block in blocks.items():
        begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
        if begin not in text or end not in text.partition(begin)[2]:
            raise ValueError(f"no {begin} ... {end} block")
        # Split and joined, not re.sub: the generated text goes in as it is (no backslash escapes).
        before, _, rest = text.partition(begin)
        _, _, after = rest.partition(end)
        text = f"{before}{begin}\n{block()}\n{end}{after}"
    return text


def stale_pages() -> list[str]:
    texts = {page: (DOCS / page).read_text() for page in PAGES}
    return [page for page, blocks in PAGES.items() if render(texts[page], blocks) != texts[page]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the generated blocks in place")
    mode.add_argument("--check", action="store_true", help="exit 1 if a page's blocks are stale")
    args = parser.parse_args(argv)
    if args.write:
        for page, blocks in PAGES.items():
            path = DOCS / page
            path.write_text(render(path.read_text(), blocks))
        return 0
    stale = stale_pages()
    for page in stale:
        print(f"docs/{page} is stale: run python docs/build_tables.py --write", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
