"""The docs say what the code does: their generated tables are the request models, the settings and metrics
classes, the dashboard builder and the alert rules as they are now; and the README stays a map."""

from __future__ import annotations

import re

from ar_service.api.protocol import ImageEditRequest, ImageGenerationRequest
from docs import build_tables

README = build_tables.ROOT / "README.md"


def test_every_generated_table_is_current():
    assert build_tables.stale_pages() == [], "run python docs/build_tables.py --write"


def test_every_public_request_field_is_described():
    for model in (ImageGenerationRequest, ImageEditRequest):
        assert all(field.description for field in model.model_fields.values()), model.__name__


def test_fields_openai_does_not_have_are_marked_as_ardits_own():
    table = build_tables.generation_fields()
    assert "| `seed` *(ardit)* |" in table and "| `prompt` |" in table and "| `size` |" in table


def test_the_readme_is_a_map_of_at_most_130_lines_whose_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 130
    assert "make run" in text and "make test" in text
    links = [link for link in re.findall(r"\]\(([^)#]+)", text) if not link.startswith("http")]
    assert links and all((build_tables.ROOT / link).exists() for link in links), links


def test_every_docs_page_is_in_the_index_and_its_links_resolve():
    index = (build_tables.DOCS / "README.md").read_text()
    pages = sorted(p.name for p in build_tables.DOCS.glob("*.md") if p.name != "README.md")
    assert all(f"]({page})" in index for page in pages), pages
    for page in build_tables.DOCS.glob("*.md"):
        for link in re.findall(r"\]\(([^)#]+)", page.read_text()):
            if not link.startswith("http"):
                assert (page.parent / link).exists(), (page.name, link)


def test_the_reading_order_names_files_that_exist():
    files = re.findall(r"`((?:ar_service|dit_service|shared|services)/[\w/]+\.py)`", README.read_text())
    assert len(files) >= 15 and all((build_tables.ROOT / f).exists() for f in files), files
