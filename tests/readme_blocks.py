"""Generated blocks of README.md: the text between ``<!-- KEY:begin -->`` and ``<!-- KEY:end -->``.

Each generator module (``tests.readme_settings``, ``tests.readme_operating``) says what its blocks
hold; this module replaces them and gives each the same ``--write`` command line.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def verbatim(text: str) -> Callable[[re.Match[str]], str]:
    """A ``re.sub`` replacement that inserts ``text`` as it is (a string replacement would expand its backslashes)."""
    return lambda _: text


def render(readme: str, blocks: Mapping[str, Callable[[], str]]) -> str:
    """``readme`` with each block's text replaced by what its generator returns now."""
    for key, block in blocks.items():
        begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
        pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
        if not pattern.search(readme):
            raise ValueError(f"README.md has no {begin} ... {end} block")
        text = f"{begin}\n{block()}\n{end}"
        readme = pattern.sub(verbatim(text), readme)
    return readme


def main(description: str | None, blocks: Mapping[str, Callable[[], str]]) -> None:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--write", action="store_true", help="rewrite README.md's blocks in place")
    text = README.read_text()
    if parser.parse_args().write:
        README.write_text(render(text, blocks))
    else:
        print(render(text, blocks))
