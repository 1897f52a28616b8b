"""A new family is one model card: a card added under a new class name (a copy of Z-Image's, its folder's
``model_index.json`` naming that class) is what both running services read — the DiT announces its description,
defaults and recipe and renders through the pipeline it names, the AR captures by its recipe and is ready beside
that DiT — with no other change."""

from __future__ import annotations

import base64
import io
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from PIL import Image

from ar_service.app import create_ar_app
from ar_service.settings import ArSettings
from dit_service.app import create_dit_app
from dit_service.settings import DitSettings
from services.checkpoints import Z_IMAGE_MODEL, default_model_dir
from services.model_card import CARDS, PIPELINE_INDEX, Z_IMAGE, ModelCard
from tests.conftest import HANDOFF_TOKEN, require_checkpoint
from tests.support.live_server import LiveServer

pytestmark = pytest.mark.slow

NEW_FAMILY = "ZImageCopyPipeline"
NEW_CARD = Z_IMAGE.model_copy(
    update={
        "family": NEW_FAMILY,
        "description": "a copy of Z-Image's card under a new class name",
        "default_size": "64x64",
        "default_num_inference_steps": 2,
    }
)


def folder_of_the_new_family(tmp_path: Path) -> Path:
    folder = tmp_path / "z-image-copy"
    shutil.copytree(require_checkpoint(default_model_dir(Z_IMAGE_MODEL)), folder)
    index = json.loads((folder / PIPELINE_INDEX).read_text())
    (folder / PIPELINE_INDEX).write_text(json.dumps(index | {"_class_name": NEW_FAMILY}))
    return folder


@dataclass(frozen=True)
class Pair:
    folder: Path
    dit: LiveServer
    ar: LiveServer


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Iterator[Pair]:
    folder = folder_of_the_new_family(tmp_path_factory.mktemp("new-family"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(CARDS, NEW_FAMILY, NEW_CARD)
        dit = LiveServer(create_dit_app(DitSettings(model_dir=folder, handoff_token=HANDOFF_TOKEN))).start()
        try:
            dit.wait_ready()
            ar_settings = ArSettings(model_dir=folder, dit_url=dit.url, handoff_token=HANDOFF_TOKEN)
            ar = LiveServer(create_ar_app(ar_settings)).start()
            try:
                yield Pair(folder, dit, ar.wait_ready())
            finally:
                ar.stop()
        finally:
            dit.stop()


def test_the_dit_announces_the_new_cards_description_defaults_and_recipe(pair):
    capabilities = httpx.get(f"{pair.dit.url}/readyz").json()["capabilities"]
    assert capabilities["description"] == NEW_CARD.description
    assert (capabilities["defaults"]["width"], capabilities["defaults"]["num_inference_steps"]) == (64, 2)
    assert capabilities["cfg_above"] == NEW_CARD.cfg_above
    rows = ModelCard.read(pair.folder).rows
    assert rows is not None and capabilities["rows"] == rows.model_dump(mode="json")


def test_the_ar_reads_rows_by_the_new_cards_recipe_and_renders_through_its_pipeline(pair):
    assert pair.ar.app.state.runtime.engine.rows == ModelCard.read(pair.folder).rows
    client = OpenAI(base_url=f"{pair.ar.url}/v1", api_key="-", max_retries=0)
    result = client.images.generate(prompt="a red circle", extra_body={"seed": 7})
    assert result.data is not None
    image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json or "")))
    assert image.size == (64, 64)
