"""The README's settings tables, generated from the settings classes (so they cannot drift).

``python -m tests.readme_settings --write`` rewrites the tables in README.md between their
markers; tests/test_readme.py fails when the committed README differs from what this generates.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

from ar_service.settings import ArSettings
from dit_service.settings import DitSettings
from tests import readme_blocks

TABLES: dict[str, type[BaseSettings]] = {"ar": ArSettings, "dit": DitSettings}


def env_name(settings: type[BaseSettings], name: str, field: FieldInfo) -> str:
    alias = field.validation_alias
    return alias if isinstance(alias, str) else f"{settings.model_config['env_prefix']}{name.upper()}"


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        if isinstance(value, Path):
            return f"`$ARDIT_CACHE_DIR/models/{value.name}`"
    else:
        value = field.default
    if value is None or value is PydanticUndefined:
        return "—"
    if isinstance(value, (list, frozenset, set)) and not value:
        return "[]"
    text = str(value).replace("\n", "\\n").replace("|", "\\|")
    return f"`{text}`" if len(text) <= 40 else f"`{text[:37]}...`"


def table(settings: type[BaseSettings]) -> str:
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, field in settings.model_fields.items():
        rows.append(f"| `{env_name(settings, name, field)}` | {default_text(field)} | {field.description or ''} |")
    return "\n".join(rows)


BLOCKS = {f"settings:{key}": partial(table, settings) for key, settings in TABLES.items()}


def render(readme: str) -> str:
    return readme_blocks.render(readme, BLOCKS)


if __name__ == "__main__":
    readme_blocks.main(__doc__, BLOCKS)
