"""README.md says what the code does: its settings tables are the settings classes, its operating lists the
metrics classes, the dashboard builder and the alert rules."""

from __future__ import annotations

from tests import readme_operating, readme_settings
from tests.readme_blocks import README


def test_settings_tables_match_the_settings_classes():
    readme = README.read_text()
    assert readme_settings.render(readme) == readme, (
        "README settings tables are stale: run python -m tests.readme_settings --write"
    )


def test_operating_lists_match_the_metrics_the_dashboard_and_the_rules():
    readme = README.read_text()
    assert readme_operating.render(readme) == readme, (
        "README operating lists are stale: run python -m tests.readme_operating --write"
    )
