"""README.md says what the code does: its settings tables are the settings classes."""

from __future__ import annotations

from tests.readme_settings import README, render


def test_settings_tables_match_the_settings_classes():
    readme = README.read_text()
    assert render(readme) == readme, "README settings tables are stale: run python -m tests.readme_settings --write"
