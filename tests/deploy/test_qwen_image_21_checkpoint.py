"""The tiny Qwen-Image-2.1 ``make checkpoints`` builds is in the layout its pipeline saves: diffusers' own
``QwenImage21Pipeline`` loads it with the processor as its only tokenizer, its Qwen3-VL text encoder and transformer
fit each other's widths, its VAE reads and draws RGBA, its norms are not left at ones. How sensitive it is (the rows'
plausible mistakes against its bf16 error) is shown where the reference tests use it:
tests/e2e/test_qwen_image_21_reference.py's ``test_the_checks_catch_*``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from safetensors import safe_open

from services.checkpoints import QWEN_IMAGE_21_MODEL, default_model_dir
from services.model_card import ModelCard
from tests.conftest import require_checkpoint

FOLDER = default_model_dir(QWEN_IMAGE_21_MODEL)


def folder_json(path: str) -> dict[str, Any]:
    value = json.loads((require_checkpoint(FOLDER) / path).read_text())
    assert isinstance(value, dict)
    return value


def test_its_index_names_the_pipeline_and_its_five_parts_with_no_tokenizer():
    index = folder_json("model_index.json")
    assert index["_class_name"] == "QwenImage21Pipeline"
    assert {name for name in index if not name.startswith("_")} == {
        "scheduler",
        "vae",
        "text_encoder",
        "processor",
        "transformer",
        "sample_sigmas",
    }
    assert not (FOLDER / "tokenizer").exists()
    assert {"tokenizer.json", "vocab.json", "merges.txt"} <= {p.name for p in (FOLDER / "processor").iterdir()}


def test_its_parts_fit_each_other():
    text = folder_json("text_encoder/config.json")
    transformer, vae = folder_json("transformer/config.json"), folder_json("vae/config.json")
    assert text["architectures"] == ["Qwen3VLForConditionalGeneration"] and "vision_config" in text
    assert transformer["context_in_dim"] == text["text_config"]["hidden_size"] == 128
    assert transformer["in_channels"] == vae["z_dim"] == 64
    assert (vae["in_channels"], vae["out_channels"]) == (4, 4)  # RGBA
    assert ModelCard.read(FOLDER).family == "QwenImage21Pipeline"


@pytest.mark.parametrize("part", ["text_encoder/model.safetensors", "transformer/diffusion_pytorch_model.safetensors"])
def test_its_norms_are_drawn_not_left_at_ones(part):
    with safe_open(str(require_checkpoint(FOLDER) / part), "pt") as weights:
        norms = [weights.get_tensor(k) for k in weights.keys() if "norm" in k and k.endswith("weight")]  # noqa: SIM118
    assert norms and all(norm.float().std().item() > 0.1 for norm in norms)
