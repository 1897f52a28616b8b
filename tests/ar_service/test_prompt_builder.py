import pytest

from ar_service.prompt_builder import PromptBuilder
from ar_service.settings import ArSettings
from shared.row_recipe import QWEN_IMAGE_TEMPLATE
from tests.conftest import require_checkpoint


@pytest.fixture
def settings() -> ArSettings:
    settings = ArSettings()
    require_checkpoint(settings.model_dir)
    return settings


def test_prefix_tokens_are_exactly_the_template_before_the_prompt(settings):
    builder = PromptBuilder.from_model_dir(settings.model_dir, QWEN_IMAGE_TEMPLATE)
    built = builder.build("a red fox in the snow")
    prefix = builder.tokenizer.decode(built.token_ids[: built.prefix_tokens])
    assert prefix == QWEN_IMAGE_TEMPLATE.split("{}")[0]
    assert builder.decode(built.token_ids[built.prefix_tokens :]).startswith("a red fox in the snow")
    # Qwen-Image's system prefix is 34 SmolLM2 tokens: the rows the DiT drops.
    assert built.prefix_tokens == 34


def test_template_needs_one_placeholder(settings):
    try:
        PromptBuilder.from_model_dir(settings.model_dir, "no placeholder")
    except ValueError as exc:
        assert "{}" in str(exc)
    else:
        raise AssertionError("a template without {} was accepted")


def test_a_dropped_prefix_leaves_out_only_its_own_rows(settings):
    """Qwen-Image-2.1 drops its system message and keeps the user turn's opening: the prefix is that message alone."""
    from transformers import AutoTokenizer

    from ar_service.engine.text_model import TextModel
    from shared.row_recipe import QWEN_IMAGE_21_SYSTEM, QWEN_IMAGE_21_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(str(TextModel.read(settings.model_dir).tokenizer_dir))
    builder = PromptBuilder(tokenizer, QWEN_IMAGE_21_TEMPLATE, dropped_prefix=QWEN_IMAGE_21_SYSTEM)
    built = builder.build("a red fox")
    assert tokenizer.decode(built.token_ids[: built.prefix_tokens]) == QWEN_IMAGE_21_SYSTEM
    assert str(tokenizer.decode(built.token_ids[built.prefix_tokens :])).startswith("<|im_start|>user\na red fox")
    with pytest.raises(ValueError, match="not the start of the template"):
        PromptBuilder(tokenizer, QWEN_IMAGE_21_TEMPLATE, dropped_prefix="<|im_start|>user\n")


def test_the_ar_counts_picture_tokens_with_the_image_processor_class_the_edit_pipeline_loads():
    """transformers picks a torchvision-backed or a PIL image processor by what imports: the AR's (which sizes each
    picture's tokens) must be the class diffusers' QwenImageEditPlusPipeline loads from the same processor/."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import QwenImageEditPlusPipeline

    from ar_service.engine.text_model import TextModel
    from services.checkpoints import QWEN_IMAGE_EDIT_MODEL, default_model_dir

    folder = require_checkpoint(default_model_dir(QWEN_IMAGE_EDIT_MODEL))
    text_model = TextModel.read(folder)
    assert text_model.card_rows is not None
    ours = PromptBuilder.of_text_model(text_model, text_model.card_rows).pictures
    pipeline = QwenImageEditPlusPipeline.from_pretrained(str(folder))
    assert ours is not None
    assert type(ours.image_processor) is type(pipeline.processor.image_processor)
