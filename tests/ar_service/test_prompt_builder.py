from ar_service.prompt_builder import PromptBuilder
from ar_service.settings import ArSettings
from services.launcher import DEFAULT_TEMPLATE_PREFIX_TOKENS


def test_default_template_prefix_is_what_the_dit_drops():
    settings = ArSettings()
    builder = PromptBuilder.from_model_dir(settings.model_dir, settings.prompt_template)
    built = builder.build("a red fox in the snow")
    assert built.prefix_tokens == DEFAULT_TEMPLATE_PREFIX_TOKENS
    assert builder.decode(built.token_ids[built.prefix_tokens :]).startswith("a red fox in the snow")


def test_template_needs_one_placeholder():
    settings = ArSettings()
    try:
        PromptBuilder.from_model_dir(settings.model_dir, "no placeholder")
    except ValueError as exc:
        assert "{}" in str(exc)
    else:
        raise AssertionError("a template without {} was accepted")
