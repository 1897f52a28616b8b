"""ar_service/engine/text_model.py: which folder holds the AR's text model and tokenizer, how vLLM serves it, and
a folder that cannot serve refused in one line that names what is missing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ar_service.engine.text_model import TextModel, TextModelError
from ar_service.engine.text_towers import text_only_overrides
from services.checkpoints import FULL_QWEN_IMAGE_MODEL, QWEN_IMAGE_EDIT_MODEL, default_model_dir
from tests.conftest import PLUMBING_DIT_MODEL_DIR, require_checkpoint

FULL = default_model_dir(FULL_QWEN_IMAGE_MODEL)
NESTED = FULL.with_name(FULL.name + "-nested")
EDIT = default_model_dir(QWEN_IMAGE_EDIT_MODEL)


def copy_of(folder: Path, tmp_path: Path) -> Path:
    """A copy of ``folder`` to break: its weights linked, the rest copied (a write goes to the copy)."""

    def copy(src: str, dst: str) -> None:
        if src.endswith(".safetensors"):
            Path(dst).symlink_to(src)
        else:
            shutil.copy2(src, dst)

    target = tmp_path / folder.name
    shutil.copytree(require_checkpoint(folder), target, copy_function=copy)
    return target


@pytest.mark.parametrize("folder", [FULL, NESTED], ids=["hub-config", "transformers-5-config"])
def test_a_qwen_image_folder_serves_its_text_encoder_text_only_at_its_last_layer(folder):
    text_model = TextModel.read(require_checkpoint(folder))
    assert (text_model.weights_dir, text_model.tokenizer_dir) == (folder / "text_encoder", folder / "tokenizer")
    assert (text_model.hidden_size, text_model.num_hidden_layers) == (128, 4)
    assert text_model.card_rows is not None and text_model.card_rows.layers == [4]
    assert text_model.text_tower == "ArditQwen2_5_VLTextTower"
    assert text_model.engine_args()["hf_overrides"] is text_only_overrides


def test_an_edit_models_folder_serves_its_text_encoder_with_its_vision_tower_and_processor(tmp_path):
    text_model = TextModel.read(require_checkpoint(EDIT))
    assert text_model.text_tower is None and text_model.processor_dir == EDIT / "processor"
    assert text_model.pictures is not None and text_model.pictures.max_pictures == 3
    args = text_model.engine_args(tmp_path)
    assert (args["model"], args["skip_tokenizer_init"]) == (str(tmp_path), False)
    assert args["limit_mm_per_prompt"] == {"image": {"count": 3, "width": 384, "height": 384}, "video": 0}
    assert "hf_overrides" not in args


def test_an_edit_models_folder_without_its_processor_is_refused_naming_it(tmp_path):
    folder = copy_of(EDIT, tmp_path)
    shutil.rmtree(folder / "processor")
    with pytest.raises(TextModelError, match=r"no processor/ with preprocessor_config\.json"):
        TextModel.read(folder)


def test_a_language_models_own_folder_is_served_as_it_is():
    from ar_service.settings import ArSettings

    folder = require_checkpoint(ArSettings().model_dir)
    text_model = TextModel.read(folder)
    assert (text_model.weights_dir, text_model.tokenizer_dir, text_model.text_tower) == (folder, folder, None)
    assert text_model.card_rows is None
    assert text_model.engine_args() == {"model": str(folder), "skip_tokenizer_init": True}


def test_the_tower_config_is_a_text_model_with_one_dimensional_rope():
    from transformers import AutoConfig

    for folder in (FULL, NESTED):
        config = text_only_overrides(AutoConfig.from_pretrained(require_checkpoint(folder) / "text_encoder"))
        text = config.get_text_config()
        assert config.architectures == ["ArditQwen2_5_VLTextTower"]
        assert text.rope_parameters["rope_type"] == "default" and "mrope_section" not in text.rope_parameters
        assert text.rope_parameters["rope_theta"] == 1e6 and text.tie_word_embeddings is False
        assert text.rms_norm_eps == 1e-6  # nested in text_config only, in the transformers-5 save


def test_a_blank_config_passes_through_the_tower_overrides():
    class Blank:
        architectures = None

    blank = Blank()
    assert text_only_overrides(blank) is blank


@pytest.mark.parametrize(
    "breakage, named",
    [
        (lambda f: shutil.rmtree(f / "text_encoder"), "without its text_encoder/"),
        (lambda f: shutil.rmtree(f / "tokenizer"), "without its tokenizer/"),
        (lambda f: [p.unlink() for p in (f / "text_encoder").glob("*.safetensors")], r"no \*\.safetensors weights"),
        (lambda f: (f / "text_encoder" / "config.json").write_text("{"), "is not valid JSON"),
        (lambda f: [p.unlink() for p in (f / "tokenizer").iterdir()], "has no tokenizer"),
    ],
    ids=["no-text-encoder", "no-tokenizer-folder", "no-weights", "broken-config", "no-tokenizer-files"],
)
def test_a_folder_that_cannot_serve_is_refused_naming_what_is_missing(tmp_path, breakage, named):
    folder = copy_of(FULL, tmp_path)
    breakage(folder)
    with pytest.raises(TextModelError, match=named) as refused:
        TextModel.read(folder)
    assert "\n" not in str(refused.value)


def test_a_dit_only_folder_and_a_missing_folder_are_refused(tmp_path):
    with pytest.raises(TextModelError, match="QwenImagePipeline folder without its text_encoder/"):
        TextModel.read(require_checkpoint(PLUMBING_DIT_MODEL_DIR))
    with pytest.raises(TextModelError, match="does not exist"):
        TextModel.read(tmp_path / "absent")


def test_a_multimodal_model_without_a_text_tower_is_refused(tmp_path):
    folder = copy_of(FULL, tmp_path)
    config_path = folder / "text_encoder" / "config.json"
    config = json.loads(config_path.read_text()) | {"architectures": ["LlavaForConditionalGeneration"]}
    config_path.write_text(json.dumps(config))
    with pytest.raises(TextModelError, match=r"multimodal \(LlavaForConditionalGeneration\) with no text-only tower"):
        TextModel.read(folder)


def test_z_images_bare_qwen3_decoder_is_served_as_a_causal_model_with_its_cards_recipe():
    from transformers import AutoConfig

    from services.checkpoints import Z_IMAGE_MODEL

    folder = require_checkpoint(default_model_dir(Z_IMAGE_MODEL))
    text_model = TextModel.read(folder)
    assert (text_model.architecture, text_model.text_tower) == ("Qwen3Model", "ArditQwen3Decoder")
    assert text_model.card_rows is not None and text_model.card_rows.layers == [3]  # hidden_states[-2] of 4
    config = text_only_overrides(AutoConfig.from_pretrained(folder / "text_encoder"))
    assert config.architectures == ["ArditQwen3Decoder"] and config.tie_word_embeddings is True


def test_qwen_image_21s_qwen3_vl_is_served_text_only_with_its_processors_tokenizer():
    """Qwen-Image-2.1's pipeline has no tokenizer/: it tokenizes with its processor, whose folder holds the files. Its
    Qwen3-VL nests the language model's config, which vLLM's causal LM reads its head's size from at the top."""
    from transformers import AutoConfig

    from services.checkpoints import QWEN_IMAGE_21_MODEL

    folder = require_checkpoint(default_model_dir(QWEN_IMAGE_21_MODEL))
    text_model = TextModel.read(folder)
    assert (text_model.weights_dir, text_model.tokenizer_dir) == (folder / "text_encoder", folder / "processor")
    assert text_model.text_tower == "ArditQwen3VLTextTower" and text_model.pictures is None
    assert (
        text_model.card_rows is not None and text_model.card_rows.layers == [4] and not text_model.card_rows.final_norm
    )
    config = text_only_overrides(AutoConfig.from_pretrained(folder / "text_encoder"))
    text = config.get_text_config()
    assert config.architectures == ["ArditQwen3VLTextTower"] and "mrope_section" not in text.rope_parameters
    assert (config.vocab_size, config.hidden_size) == (text.vocab_size, text.hidden_size) == (151936, 128)


def test_a_family_folder_whose_text_encoder_lacks_the_cards_layers_is_refused_naming_them(tmp_path):
    from services.checkpoints import FLUX2_KLEIN_MODEL

    folder = copy_of(require_checkpoint(default_model_dir(FLUX2_KLEIN_MODEL)), tmp_path)
    config_path = folder / "text_encoder" / "config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"num_hidden_layers": 20}))
    with pytest.raises(TextModelError, match=r"layers \[27\]: the text encoder has 20 layers"):
        TextModel.read(folder)
