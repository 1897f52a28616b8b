"""ardit's version, from its one home, pyproject.toml, as the installed distribution reports it (both services
and the images install it; ``make setup`` in place)."""

from __future__ import annotations

from importlib.metadata import version

VERSION = version("ardit")
