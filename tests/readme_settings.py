"""The README's settings tables, generated from the settings classes (so they cannot drift).

``python -m tests.readme_settings --write`` rewrites the tables in README.md between their
markers; tests/test_readme.py fails when the committed README differs from what this generates.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

from ar_service.settings import ArSettings
from dit_service.settings import DitSettings

README = Path(__file__).resolve().parents[1] / "README.md"
TABLES: dict[str, type[BaseSettings]] = {"ar": ArSettings, "dit": DitSettings}


def verbatim(text: str) -> Callable[[re.Match[str]], str]:
    """A ``re.sub`` replacement that inserts ``text`` as it is (a string replacement would expand its backslashes)."""
    return lambda _: text


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


def render(readme: str) -> str:
    for key, settings in TABLES.items():
        begin, end = f"<!-- settings:{key}:begin -->", f"<!-- settings:{key}:end -->"
        pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
        if not pattern.search(readme):
            raise ValueError(f"README.md has no {begin} ... {end} block")
        block = f"{begin}\n{table(settings)}\n{end}"
        readme = pattern.sub(verbatim(block), readme)
    return readme


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite README.md's tables in place")
    args = parser.parse_args()
    text = README.read_text()
    if args.write:
        README.write_text(render(text))
    else:
        print(render(text))
