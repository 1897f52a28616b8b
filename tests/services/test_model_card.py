"""services/model_card.py: what a checkpoint says about itself, the layer it was trained on, and the
defaults its authors publish."""

from __future__ import annotations

import json
from pathlib import Path

from services.model_card import MODEL_CARD_FILE, ModelCard

# What Qwen/Qwen-Image ships in text_encoder/config.json (the fields read here), older and newer transformers.
QWEN_VL = ["Qwen2_5_VLForConditionalGeneration"]
QWEN_IMAGE_TEXT_ENCODER = {"architectures": QWEN_VL, "num_hidden_layers": 28}
NESTED_TEXT_ENCODER = {"architectures": QWEN_VL, "text_config": {"num_hidden_layers": 28}}


def checkpoint(
    tmp_path: Path, card: dict | None = None, text_encoder: dict | None = None, pipeline: str | None = None
) -> Path:
    if pipeline is not None:
        (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    if card is not None:
        (tmp_path / MODEL_CARD_FILE).write_text(json.dumps(card))
    if text_encoder is not None:
        (tmp_path / "text_encoder").mkdir()
        (tmp_path / "text_encoder" / "config.json").write_text(json.dumps(text_encoder))
    return tmp_path


def test_a_checkpoint_with_neither_card_nor_text_encoder_names_no_layer(tmp_path):
    assert ModelCard.read(checkpoint(tmp_path)) == ModelCard()


def test_a_real_qwen_image_without_a_card_names_its_text_encoders_last_layer(tmp_path):
    assert ModelCard.read(checkpoint(tmp_path, text_encoder=QWEN_IMAGE_TEXT_ENCODER)).hidden_layer == 28


def test_the_layer_count_is_found_in_a_nested_text_config_too(tmp_path):
    assert ModelCard.read(checkpoint(tmp_path, text_encoder=NESTED_TEXT_ENCODER)).hidden_layer == 28


def test_a_card_that_names_a_layer_wins_over_the_text_encoder(tmp_path):
    card = {"description": "fine-tuned on layer 20", "hidden_layer": 20}
    read = ModelCard.read(checkpoint(tmp_path, card=card, text_encoder=QWEN_IMAGE_TEXT_ENCODER))
    assert (read.hidden_layer, read.description) == (20, "fine-tuned on layer 20")


def test_a_card_may_name_the_cpu_threads_its_model_renders_fastest_with(tmp_path):
    assert ModelCard.read(checkpoint(tmp_path, card={"cpu_threads": 1})).cpu_threads == 1


def test_qwen_image_as_published_is_served_with_its_authors_defaults(tmp_path):
    read = ModelCard.read(checkpoint(tmp_path, text_encoder=QWEN_IMAGE_TEXT_ENCODER, pipeline="QwenImagePipeline"))
    assert (read.default_guidance_scale, read.default_negative_prompt) == (4.0, " ")  # true_cfg_scale=4
    assert (read.default_num_inference_steps, read.default_size, read.hidden_layer) == (50, "1328x1328", 28)


def test_a_dit_only_folder_is_not_taken_for_the_published_model(tmp_path):
    assert ModelCard.read(checkpoint(tmp_path, pipeline="QwenImagePipeline")) == ModelCard()


def test_a_folders_own_card_replaces_the_published_defaults(tmp_path):
    folder = checkpoint(
        tmp_path, card={"default_size": "64x64"}, text_encoder=QWEN_IMAGE_TEXT_ENCODER, pipeline="QwenImagePipeline"
    )
    read = ModelCard.read(folder)
    assert (read.default_size, read.default_guidance_scale, read.hidden_layer) == ("64x64", None, 28)
