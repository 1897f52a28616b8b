"""services/model_card.py: one card per diffusers family, as a folder has it: how its rows are read from its text
encoder, the defaults its authors publish, and what the folder's own ``ardit.json`` replaces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.model_card import (
    CARDS,
    FLUX2_KLEIN,
    MODEL_CARD_FILE,
    PUBLISHED,
    QWEN_IMAGE,
    QWEN_IMAGE_21,
    QWEN_IMAGE_EDIT_PLUS,
    Z_IMAGE,
    ModelCard,
)
from shared.row_recipe import QWEN_IMAGE_21_SYSTEM, QWEN_IMAGE_21_TEMPLATE, QWEN_IMAGE_TEMPLATE, RowRecipe

# What Qwen/Qwen-Image ships in text_encoder/config.json (the fields read here), older and newer transformers.
QWEN_VL = ["Qwen2_5_VLForConditionalGeneration"]
QWEN_IMAGE_TEXT_ENCODER = {"architectures": QWEN_VL, "num_hidden_layers": 28}
NESTED_TEXT_ENCODER = {"architectures": QWEN_VL, "text_config": {"num_hidden_layers": 28}}
# Z-Image's text encoder (transformers' Qwen3Model, Qwen3-4B's 36 layers) and FLUX.2 [klein] 4B's.
Z_IMAGE_TEXT_ENCODER = {"architectures": ["Qwen3Model"], "num_hidden_layers": 36}
FLUX2_KLEIN_TEXT_ENCODER = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 36}


def checkpoint(
    tmp_path: Path,
    card: dict | None = None,
    text_encoder: dict | None = None,
    pipeline: str | None = "QwenImagePipeline",
) -> Path:
    if pipeline is not None:
        (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    if card is not None:
        (tmp_path / MODEL_CARD_FILE).write_text(json.dumps(card))
    if text_encoder is not None:
        (tmp_path / "text_encoder").mkdir()
        (tmp_path / "text_encoder" / "config.json").write_text(json.dumps(text_encoder))
    return tmp_path


def unpublished(card: ModelCard) -> ModelCard:
    return card.model_copy(update=dict.fromkeys(PUBLISHED))


def test_a_checkpoint_with_neither_card_nor_text_encoder_has_its_familys_pipeline_and_nothing_published(tmp_path):
    read = ModelCard.read(checkpoint(tmp_path))
    assert read == unpublished(QWEN_IMAGE) and read.rows is None and read.edits


def test_a_folder_of_a_family_ardit_has_no_card_for_is_refused_naming_the_families_it_serves(tmp_path):
    with pytest.raises(ValueError, match="a StableDiffusionPipeline pipeline; ardit serves QwenImagePipeline, "):
        ModelCard.read(checkpoint(tmp_path, pipeline="StableDiffusionPipeline"))
    with pytest.raises(ValueError, match=r"no model_index\.json names a diffusers pipeline"):
        ModelCard.read(checkpoint(tmp_path / "no-index", pipeline=None))


def test_a_folders_card_may_not_change_its_familys_pipeline(tmp_path):
    with pytest.raises(ValueError, match=r"ardit.json sets \['batches'\]"):
        ModelCard.read(checkpoint(tmp_path, card={"batches": False, "default_size": "64x64"}))


def test_a_folders_card_without_a_recipe_reads_rows_by_its_familys_where_it_ships_its_text_encoder(tmp_path):
    folder = checkpoint(
        tmp_path, card={"default_size": "64x64"}, text_encoder=Z_IMAGE_TEXT_ENCODER, pipeline="ZImagePipeline"
    )
    read = ModelCard.read(folder)
    assert Z_IMAGE.rows is not None and read.rows == Z_IMAGE.rows.resolved(36)
    assert (read.default_size, read.default_guidance_scale) == ("64x64", None)


def test_every_family_is_keyed_by_the_class_name_its_card_gives_and_that_pipeline_draws_from_text_or_edits():
    for name, card in CARDS.items():
        assert name == card.family == (card.pipelines.get("text_to_image") or card.pipelines["reference_edit"])


@pytest.mark.parametrize(
    ("card", "draws_from_text", "pictures", "mask", "strength"),
    [
        (QWEN_IMAGE, True, 1, True, True),
        (QWEN_IMAGE_EDIT_PLUS, False, 3, False, False),
        (Z_IMAGE, True, 1, True, True),
        (FLUX2_KLEIN, True, 4, True, False),
        (QWEN_IMAGE_21, True, 0, False, False),
    ],
    ids=["qwen_image", "qwen_image_edit_plus", "z_image", "flux2_klein", "qwen_image_21"],
)
def test_each_card_says_what_its_family_draws_from(card, draws_from_text, pictures, mask, strength):
    """Qwen-Image and Z-Image start an edit from one picture noised to a strength (with a mask: inpaint);
    Qwen-Image-Edit reads up to three pictures beside the rows and draws nothing from text alone; FLUX.2's pipeline
    reads up to four itself, a strength only with a mask (inpaint); Qwen-Image-2.1 edits nothing."""
    assert card.text_to_image == draws_from_text
    assert (card.max_edit_pictures, card.edit_mask, card.edit_strength) == (pictures, mask, strength)


def test_an_edit_models_pictures_are_sized_as_its_pipeline_sizes_them():
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    reading = QWEN_IMAGE_EDIT_PLUS.reads_pictures
    assert reading is not None
    for width, height in [(448, 336), (100, 1000), (1024, 1024), (3000, 17)]:
        assert reading.condition_size(width, height) == calculate_dimensions(384 * 384, width / height)
        assert reading.vae_size(width, height) == calculate_dimensions(1024 * 1024, width / height)
    assert reading.prompt(2, "swap them") == (
        "Picture 1: <|vision_start|><|image_pad|><|vision_end|>Picture 2: <|vision_start|><|image_pad|><|vision_end|>"
        "swap them"
    )


def layers(card: ModelCard) -> list[int] | None:
    return None if card.rows is None else card.rows.layers


def test_a_real_qwen_image_without_a_card_reads_its_text_encoders_last_layer_after_the_norm(tmp_path):
    read = ModelCard.read(checkpoint(tmp_path, text_encoder=QWEN_IMAGE_TEXT_ENCODER))
    assert read.rows == RowRecipe(
        layers=[28], final_norm=True, template=QWEN_IMAGE_TEMPLATE, drops_template=True, conditioning="qwen_image"
    )


def test_the_layer_count_is_found_in_a_nested_text_config_too(tmp_path):
    assert layers(ModelCard.read(checkpoint(tmp_path, text_encoder=NESTED_TEXT_ENCODER))) == [28]


def test_a_card_that_names_a_layer_wins_over_the_text_encoder(tmp_path):
    card = {"description": "fine-tuned on layer 20", "rows": {"layers": [20]}}
    read = ModelCard.read(checkpoint(tmp_path, card=card, text_encoder=QWEN_IMAGE_TEXT_ENCODER))
    assert (layers(read), read.description) == ([20], "fine-tuned on layer 20")


def test_a_card_counting_layers_from_the_end_is_read_against_its_text_encoder(tmp_path):
    card = {"rows": {"layers": [-2, -1]}}
    assert layers(ModelCard.read(checkpoint(tmp_path, card=card, text_encoder=QWEN_IMAGE_TEXT_ENCODER))) == [27, 28]


def test_a_card_naming_a_layer_its_text_encoder_lacks_is_refused_at_start_naming_it(tmp_path):
    card = {"rows": {"layers": [9, 18, 29]}}
    with pytest.raises(ValueError, match=r"layers \[29\]: the text encoder has 28 layers"):
        ModelCard.read(checkpoint(tmp_path, card=card, text_encoder=QWEN_IMAGE_TEXT_ENCODER))


def test_a_card_counting_from_the_end_without_a_text_encoder_to_count_is_refused_at_start(tmp_path):
    with pytest.raises(ValueError, match="ships no text encoder"):
        ModelCard.read(checkpoint(tmp_path, card={"rows": {"layers": [-2]}}))


def test_z_image_as_published_reads_the_layer_before_the_last_before_the_norm_through_its_chat_template(tmp_path):
    read = ModelCard.read(checkpoint(tmp_path, text_encoder=Z_IMAGE_TEXT_ENCODER, pipeline="ZImagePipeline"))
    assert read.rows == RowRecipe(
        layers=[35],  # hidden_states[-2]
        final_norm=False,
        template=None,
        chat_template_kwargs={"enable_thinking": True},
        drops_template=False,
        conditioning="every_row",
    )
    assert (read.default_size, read.default_num_inference_steps, read.default_guidance_scale) == ("1024x1024", 9, 0)


def test_flux2_klein_as_published_reads_three_layers_side_by_side_through_its_chat_template(tmp_path):
    folder = checkpoint(tmp_path, text_encoder=FLUX2_KLEIN_TEXT_ENCODER, pipeline="Flux2KleinPipeline")
    read = ModelCard.read(folder)
    assert read.rows is not None and read.rows.layers == [9, 18, 27] and not read.rows.final_norm
    assert (read.rows.chat_template_kwargs, read.rows.drops_template) == ({"enable_thinking": False}, False)
    assert (read.default_size, read.default_num_inference_steps, read.default_guidance_scale) == ("1024x1024", 4, 1)


def test_qwen_image_21_as_published_reads_its_last_layer_before_the_norm_dropping_only_the_system_message(tmp_path):
    """Its pipeline drops the system message's rows (``_drop_idx``), not the whole template before the prompt: the
    user turn's opening conditions its DiT."""
    encoder = {"architectures": ["Qwen3VLForConditionalGeneration"], "text_config": {"num_hidden_layers": 36}}
    read = ModelCard.read(checkpoint(tmp_path, text_encoder=encoder, pipeline="QwenImage21Pipeline"))
    assert read.rows == RowRecipe(
        layers=[36], final_norm=False, template=QWEN_IMAGE_21_TEMPLATE, dropped_prefix=QWEN_IMAGE_21_SYSTEM
    )
    assert QWEN_IMAGE_21_TEMPLATE.split("{}")[0] == QWEN_IMAGE_21_SYSTEM + "<|im_start|>user\n"
    assert (read.default_size, read.default_num_inference_steps, read.default_guidance_scale) == ("1024x1024", 40, 1)
    assert read.row_width_key == "context_in_dim" and read.pipeline_needs_processor and not read.previews


def test_a_card_may_name_the_cpu_threads_its_model_renders_fastest_with(tmp_path):
    assert ModelCard.read(checkpoint(tmp_path, card={"cpu_threads": 1})).cpu_threads == 1


def test_qwen_image_as_published_is_served_with_its_authors_defaults(tmp_path):
    read = ModelCard.read(checkpoint(tmp_path, text_encoder=QWEN_IMAGE_TEXT_ENCODER, pipeline="QwenImagePipeline"))
    assert (read.default_guidance_scale, read.default_negative_prompt) == (4.0, " ")  # true_cfg_scale=4
    assert (read.default_num_inference_steps, read.default_size, layers(read)) == (50, "1328x1328", [28])


def test_a_dit_only_folder_is_not_taken_for_the_published_model(tmp_path):
    assert ModelCard.read(checkpoint(tmp_path, pipeline="QwenImagePipeline")) == unpublished(QWEN_IMAGE)


def test_a_folders_own_card_replaces_the_published_defaults(tmp_path):
    folder = checkpoint(
        tmp_path, card={"default_size": "64x64"}, text_encoder=QWEN_IMAGE_TEXT_ENCODER, pipeline="QwenImagePipeline"
    )
    read = ModelCard.read(folder)
    assert (read.default_size, read.default_guidance_scale, layers(read)) == ("64x64", None, [28])
