"""Validation on its own, without an engine: a public request against the DiT's announced limits
and the AR's own, into the one validated type the rest of the AR takes."""

from __future__ import annotations

import asyncio
import io
from typing import Any

import PIL.Image
import pytest
from pydantic import ValidationError

from ar_service.api.edit_form import EditForm, Upload
from ar_service.api.protocol import ImageEditRequest, ImageGenerationRequest
from ar_service.api.validation import (
    STRENGTH_BY_FIDELITY,
    RequestValidator,
    ValidGeneration,
    cache_salt,
    edit_strength,
)
from ar_service.engine.text_model import TextModel
from ar_service.input_images import EditMemory
from ar_service.prompt_builder import PromptBuilder
from ar_service.settings import ArSettings
from services.checkpoints import QWEN_IMAGE_EDIT_MODEL, default_model_dir
from services.errors import ApiError
from shared.diffusion import FirstBlockCache, StepCache, TaylorSeerCache
from tests.conftest import require_checkpoint
from tests.support.capabilities import DIT


@pytest.fixture(scope="module")
def validator() -> RequestValidator:
    settings = ArSettings(max_new_tokens_limit=16)
    text_model = TextModel.read(require_checkpoint(settings.model_dir))
    prompts = PromptBuilder.of_text_model(text_model, settings.rows(text_model.card_rows))
    return RequestValidator(settings, prompts, EditMemory(settings.max_edit_memory_bytes))


@pytest.fixture
def translate(validator):
    def translate(**body: Any) -> ValidGeneration:
        request = ImageGenerationRequest.model_validate({"prompt": "a red circle", **body})
        return validator.generation(request, "req_1", 0.0, DIT)

    return translate


@pytest.fixture
def refused(translate):
    def refused(**body: Any) -> ApiError:
        with pytest.raises(ApiError) as info:
            translate(**body)
        assert info.value.status == 400
        return info.value

    return refused


def test_auto_size_steps_and_guidance_are_the_dits_defaults(translate):
    gen = translate().generation
    d = gen.diffusion
    assert (d.width, d.height, d.num_inference_steps, d.guidance_scale) == (64, 48, 12, 1.0)
    assert set(gen.prompts) == {"cond"}


def test_the_prompt_travels_templated_with_its_prefix_counted(translate, validator):
    prompt = translate().generation.prompts["cond"]
    assert prompt.token_ids == validator.prompt_token_ids("a red circle") and 0 < prompt.prefix_tokens < len(
        prompt.token_ids
    )


def test_quality_and_explicit_steps_choose_the_steps(translate):
    assert translate(quality="low").generation.diffusion.num_inference_steps == 4
    assert translate(quality="high", num_inference_steps=3).generation.diffusion.num_inference_steps == 3


def test_only_guidance_over_one_turns_on_cfg_and_encodes_the_negative_prompt(translate, validator):
    assert translate(guidance_scale=4.0).generation.prompts["uncond"].token_ids == validator.prompt_token_ids(" ")
    blurry = translate(guidance_scale=4.0, negative_prompt="blurry").generation.prompts["uncond"]
    assert blurry.token_ids == validator.prompt_token_ids("blurry")
    # Without CFG a negative prompt would change nothing: it is not prefilled (the DiT's default here is 1).
    assert set(translate(negative_prompt="blurry").generation.prompts) == {"cond"}
    assert set(translate(negative_prompt="blurry", guidance_scale=1.0).generation.prompts) == {"cond"}


def test_an_unseeded_request_gets_a_seed_derived_from_its_id(translate):
    assert translate().generation.diffusion.seed == translate().generation.diffusion.seed


def test_partial_images_only_travel_when_streaming(translate):
    assert translate(partial_images=2).generation.diffusion.partial_images == 0
    assert translate(partial_images=2, stream=True).generation.diffusion.partial_images == 2


def test_the_response_is_shaped_by_what_the_request_asked(translate):
    options = translate(stream=True, response_format="url", quality="high", user="u").response
    assert (options.event_prefix, options.stream, options.response_format) == ("image_generation", True, "url")
    assert (options.quality, options.safety_identifier) == ("high", "u")
    assert translate(quality="auto").response.quality is None


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"size": "40x40"}, "size", "invalid_size"),
        ({"size": "512x512"}, "size", "invalid_size"),
        ({"size": "0x16"}, "size", "invalid_size"),
        ({"n": 5}, "n", "invalid_value"),
        ({"num_inference_steps": 1}, "num_inference_steps", "invalid_value"),
        ({"num_inference_steps": 41}, "num_inference_steps", "invalid_value"),
        ({"guidance_scale": 10.5}, "guidance_scale", "invalid_value"),
        ({"output_format": "webp"}, "output_format", "unsupported_value"),
        ({"output_compression": 50}, "output_compression", "invalid_value"),
        ({"background": "transparent"}, "background", "unsupported_value"),
        ({"max_new_tokens": 17}, "max_new_tokens", "invalid_value"),
        ({"seed": 2**63 - 1, "n": 2}, "seed", "invalid_value"),
        ({"prompt": "red " * 2000}, "prompt", "context_length_exceeded"),
        ({"negative_prompt": "red " * 2000, "guidance_scale": 2.0}, "negative_prompt", "context_length_exceeded"),
        ({"model": "dall-e-3"}, "model", "model_not_found"),
    ],
)
def test_what_cannot_be_served_is_refused_naming_the_public_param(translate, body, param, code):
    with pytest.raises(ApiError) as info:
        translate(**body)
    assert (info.value.param, info.value.code) == (param, code)


def test_a_custom_schedule_sets_the_steps_and_travels_to_the_dit(translate):
    d = translate(sigmas=[1.0, 0.7, 0.4, 0.1]).generation.diffusion
    assert (d.num_inference_steps, d.sigmas) == (4, [1.0, 0.7, 0.4, 0.1])
    assert translate(sigmas=[1.0, 0.5], num_inference_steps=2).generation.diffusion.num_inference_steps == 2


@pytest.mark.parametrize(
    "body",
    [
        {"sigmas": [1.0, 0.5], "num_inference_steps": 3},  # not one per step
        {"sigmas": [0.5]},  # one step: under the DiT's fewest (2)
        {"sigmas": [1 - i / 50 for i in range(41)]},  # 41 steps: over the DiT's most (40)
    ],
)
def test_a_schedule_the_dit_cannot_run_is_refused_naming_sigmas(translate, body):
    with pytest.raises(ApiError) as info:
        translate(**body)
    assert (info.value.status, info.value.param) == (400, "sigmas")


@pytest.mark.parametrize("sigmas", [[1.0, 1.0], [0.5, 0.9], [1.2, 0.5], ["1.0", "0.5"], []])
def test_a_schedule_that_makes_no_sense_is_refused_by_the_model(sigmas):
    with pytest.raises(ValidationError):
        ImageGenerationRequest.model_validate({"prompt": "x", "sigmas": sigmas})


def test_the_dits_default_step_cache_travels_unless_the_request_names_one_or_none(validator):
    default = FirstBlockCache(method="first_block", threshold=0.1)
    dit = DIT.model_copy(update={"defaults": DIT.defaults.model_copy(update={"step_cache": default})})

    def step_cache(**body: Any) -> StepCache | None:
        request = ImageGenerationRequest.model_validate({"prompt": "a red circle", **body})
        return validator.generation(request, "req_1", 0.0, dit).generation.diffusion.step_cache

    assert step_cache() == default
    assert step_cache(step_cache={"method": "none"}) is None
    asked = step_cache(step_cache={"method": "taylorseer", "interval": 3})
    assert asked == TaylorSeerCache(method="taylorseer", interval=3)
    # The bounds themselves are accepted (one past them is refused below).
    assert step_cache(step_cache={"method": "taylorseer", "interval": 10}) == TaylorSeerCache(
        method="taylorseer", interval=10
    )
    assert step_cache(step_cache={"method": "first_block", "threshold": 1}) == FirstBlockCache(
        method="first_block", threshold=1.0
    )


def test_a_default_step_cache_some_dit_cannot_run_is_left_off_rather_than_refused(validator):
    default = FirstBlockCache(method="first_block", threshold=0.1)
    dit = DIT.model_copy(
        update={
            "defaults": DIT.defaults.model_copy(update={"step_cache": default}),
            "limits": DIT.limits.model_copy(update={"step_caches": ["taylorseer"]}),
        }
    )
    request = ImageGenerationRequest.model_validate({"prompt": "a red circle"})
    assert validator.generation(request, "req_1", 0.0, dit).generation.diffusion.step_cache is None


def test_a_step_cache_the_dit_does_not_offer_is_refused_naming_step_cache(validator):
    dit = DIT.model_copy(update={"limits": DIT.limits.model_copy(update={"step_caches": []})})
    request = ImageGenerationRequest.model_validate(
        {"prompt": "a red circle", "step_cache": {"method": "first_block", "threshold": 0.1}}
    )
    with pytest.raises(ApiError) as info:
        validator.generation(request, "req_1", 0.0, dit)
    assert (info.value.status, info.value.param) == (400, "step_cache")


@pytest.mark.parametrize(
    "step_cache",
    [
        {"method": "first_block", "threshold": 0},
        {"method": "first_block", "threshold": 1.5},
        {"method": "taylorseer", "interval": 11},
        {"method": "taylorseer", "interval": 2.5},
        {"method": "first_block"},
        {"method": "teacache"},
        {"method": "none", "threshold": 0.1},
    ],
)
def test_a_step_cache_outside_its_shape_is_refused_by_the_model(step_cache):
    with pytest.raises(ValidationError):
        ImageGenerationRequest.model_validate({"prompt": "a red circle", "step_cache": step_cache})


def test_a_prompt_over_the_dits_conditioning_rows_is_refused_before_any_work(translate):
    # 64 rows is the test DiT's limit; the AR's own token limit (1024) is not reached.
    with pytest.raises(ApiError) as info:
        translate(prompt="red " * 100)
    assert (info.value.param, info.value.code) == ("prompt", "context_length_exceeded")
    assert "at most 64" in info.value.message


def test_the_newest_fields_are_accepted_and_change_nothing_here(translate):
    plain = translate(seed=1).generation
    newest = translate(
        seed=1,
        safety_identifier="hash",
        user="u",
        moderation="low",
        style="natural",
        complexity="high",
        frame_count=4,
        frame_duration_ms=100,
        svg={"model": "m", "reasoning": {"effort": "low"}},
    ).generation
    assert newest.diffusion == plain.diffusion and newest.prompts == plain.prompts


@pytest.mark.parametrize("fmt", ["gif", "svg"])
def test_output_formats_this_model_cannot_make_are_refused(refused, fmt):
    error = refused(output_format=fmt)
    assert (error.param, error.code) == ("output_format", "unsupported_value")


def test_the_safety_identifier_echoed_is_openais_effective_one():
    def effective(**body: Any) -> str | None:
        return ImageGenerationRequest.model_validate({"prompt": "x", **body}).effective_safety_identifier

    assert effective(safety_identifier="s", user="u") == "s"
    assert effective(safety_identifier="", user="u") == "u"
    assert effective() is None


def edit_request(**body: Any) -> ImageEditRequest:
    return ImageEditRequest.model_validate({"prompt": "x", **body})


def test_edit_strength_is_given_or_follows_input_fidelity():
    assert edit_strength(edit_request(strength=0.9, input_fidelity="high")) == 0.9
    assert edit_strength(edit_request(input_fidelity="high")) == STRENGTH_BY_FIDELITY["high"]
    assert edit_strength(edit_request()) == edit_strength(edit_request(input_fidelity="low")) == 0.6


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.new("RGB", (width, height), (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_an_edit_takes_its_size_from_its_pixels(validator):
    form = EditForm(edit_request(size="auto", n=2), [Upload("a.png", png(96, 32))], None)
    valid = asyncio.run(validator.edit(form, "req_1", 0.0, DIT))
    gen = valid.generation
    assert (gen.diffusion.width, gen.diffusion.height, gen.diffusion.num_images) == (96, 32, 2)
    assert gen.edit is not None and gen.edit.frames.keys() == {("image", 0)}
    assert len(gen.edit.frames["image", 0]) == 96 * 32 * 3
    assert [(p.width, p.height) for p in gen.edit.spec.pictures] == [(96, 32)] and gen.edit.spec.strength == 0.6
    assert valid.response.event_prefix == "image_edit"


def test_an_edit_of_several_images_is_refused_before_anything_else(validator):
    form = EditForm(edit_request(), [Upload("a.png", b"a"), Upload("b.png", b"b")], None)
    with pytest.raises(ApiError) as info:
        asyncio.run(validator.edit(form, "req_1", 0.0, DIT))
    assert (info.value.status, info.value.param, info.value.code) == (400, "image", "unsupported_value")


def test_a_tenant_salts_the_prefix_cache_before_the_requests_own_salt():
    assert cache_salt(None, None) is None and cache_salt(None, "mine") == "mine"
    assert cache_salt("tenant-a", None) != cache_salt("tenant-b", None)
    # A tenant that sends another's salt string still lands in its own namespace.
    salted = cache_salt("tenant-a", "x")
    assert salted is not None and salted != cache_salt("tenant-b", "x") and salted.endswith("x")


# A DiT whose model card lists the sizes it draws well.
SIZED = DIT.model_copy(
    update={
        "limits": DIT.limits.model_copy(update={"sizes": ["64x64", "128x64"]}),
        "defaults": DIT.defaults.model_copy(update={"width": 64, "height": 64}),
    }
)


def test_a_listed_size_is_drawn_and_auto_is_the_cards_default(validator):
    def size(asked: str) -> tuple[int, int]:
        request = ImageGenerationRequest.model_validate({"prompt": "a red circle", "size": asked})
        diffusion = validator.generation(request, "req_1", 0.0, SIZED).generation.diffusion
        return diffusion.width, diffusion.height

    assert size("128x64") == (128, 64)
    assert size("auto") == (64, 64)


def test_a_size_the_model_does_not_list_is_refused_naming_the_sizes_it_draws(validator):
    request = ImageGenerationRequest.model_validate({"prompt": "a red circle", "size": "256x256"})
    with pytest.raises(ApiError) as info:
        validator.generation(request, "req_1", 0.0, SIZED)
    assert (info.value.status, info.value.param, info.value.code) == (400, "size", "invalid_size")
    assert info.value.message == "Invalid value: '256x256'. Supported values are: '64x64', '128x64', and 'auto'."


def test_an_auto_sized_edit_is_drawn_at_the_listed_size_nearest_its_shape(validator):
    form = EditForm(edit_request(size="auto"), [Upload("a.png", png(96, 32))], None)
    diffusion = asyncio.run(validator.edit(form, "req_1", 0.0, SIZED)).generation.diffusion
    assert (diffusion.width, diffusion.height) == (128, 64)


def test_an_edit_at_a_size_the_model_does_not_list_is_refused_before_its_image_is_decoded(validator):
    form = EditForm(edit_request(size="96x32"), [Upload("a.png", b"not an image")], None)
    with pytest.raises(ApiError) as info:
        asyncio.run(validator.edit(form, "req_1", 0.0, SIZED))
    assert (info.value.status, info.value.param, info.value.code) == (400, "size", "invalid_size")


def test_url_images_need_an_address_to_link_where_the_service_listens_on_every_address(validator):
    everywhere = RequestValidator(
        ArSettings(max_new_tokens_limit=16, host="0.0.0.0"), validator.prompts, EditMemory(1 << 20)
    )
    request = ImageGenerationRequest.model_validate({"prompt": "a red circle", "response_format": "url"})
    with pytest.raises(ApiError) as info:
        everywhere.generation(request, "req_1", 0.0, DIT)
    assert (info.value.status, info.value.param) == (400, "response_format")
    assert "ARDIT_AR_PUBLIC_BASE_URL" in info.value.message
    assert everywhere.generation(request.model_copy(update={"response_format": "b64_json"}), "req_1", 0.0, DIT)


def test_url_images_belong_to_the_key_that_asked(validator):
    request = ImageGenerationRequest.model_validate({"prompt": "a red circle", "response_format": "url"})
    assert validator.generation(request, "req_1", 0.0, DIT, "tenant-a").response.owner == "tenant-a"
    assert validator.generation(request, "req_1", 0.0, DIT).response.owner == ""


# --- an edit model whose encoder reads the pictures (Qwen-Image-Edit-2511's card) --------------------------

EDIT_DIT = DIT.model_copy(
    update={
        "model": "qwen-image-edit-tiny",
        "limits": DIT.limits.model_copy(
            update={
                "max_pixels": 1024 * 1024,
                "max_conditioning_rows": 1024,
                "text_to_image": False,
                "max_edit_pictures": 3,
                "edit_mask": False,
                "edit_strength": False,
            }
        ),
    }
)


@pytest.fixture(scope="module")
def edit_validator() -> RequestValidator:
    settings = ArSettings(model_dir=require_checkpoint(default_model_dir(QWEN_IMAGE_EDIT_MODEL)))
    text_model = TextModel.read(settings.model_dir)
    prompts = PromptBuilder.of_text_model(text_model, settings.rows(text_model.card_rows))
    return RequestValidator(settings, prompts, EditMemory(settings.max_edit_memory_bytes))


def reference_edit(validator: RequestValidator, *sizes: tuple[int, int], **body: Any) -> ValidGeneration:
    form = EditForm(edit_request(**body), [Upload(f"{n}.png", png(*size)) for n, size in enumerate(sizes)], None)
    return asyncio.run(validator.edit(form, "req_1", 0.0, EDIT_DIT))


def refused_edit(validator: RequestValidator, *sizes: tuple[int, int], mask: bool = False, **body: Any) -> ApiError:
    uploads = [Upload(f"{n}.png", png(*size)) for n, size in enumerate(sizes)]
    form = EditForm(edit_request(**body), uploads, Upload("m.png", png(*sizes[0])) if mask else None)
    with pytest.raises(ApiError) as info:
        asyncio.run(validator.edit(form, "req_1", 0.0, EDIT_DIT))
    assert info.value.status == 400
    return info.value


def test_an_edit_models_pictures_are_read_by_every_streams_prompt_and_sent_at_their_vae_size(edit_validator):
    valid = reference_edit(edit_validator, (96, 64), (64, 96), size="auto", guidance_scale=4.0)
    generation = valid.generation
    assert [p.size for p in generation.pictures] == [(480, 320), (320, 480)]  # the 384x384 area, at each aspect
    assert generation.edit is not None and generation.edit.spec.strength is None
    assert [(p.width, p.height) for p in generation.edit.spec.pictures] == [(1248, 832), (832, 1248)]
    d = generation.diffusion
    assert (d.width, d.height) == (832, 1248)  # size=auto: the last picture's, as the pipeline sizes it
    for prompt in generation.prompts.values():  # the negative prompt reads the pictures too
        assert prompt.engine_token_ids is not None and prompt.picture_tokens > 2 * 100
    valid.release()


@pytest.mark.parametrize(
    ("body", "param"),
    [({"strength": 0.5}, "strength"), ({"input_fidelity": "high"}, "input_fidelity")],
)
def test_an_edit_model_refuses_a_strength_naming_the_field(edit_validator, body, param):
    assert refused_edit(edit_validator, (96, 64), **body).param == param


def test_an_edit_model_refuses_a_mask_more_pictures_than_it_reads_and_a_too_elongated_one(edit_validator):
    assert refused_edit(edit_validator, (96, 64), mask=True).param == "mask"
    too_many = refused_edit(edit_validator, *[(96, 64)] * 4)
    assert too_many.param == "image" and "at most 3" in too_many.message
    thin = refused_edit(edit_validator, (96, 64), (6000, 2), size="64x64")
    assert (thin.param, thin.code) == ("image", "invalid_image_size")
    assert edit_validator.edit_memory.held == 0  # nothing held by a refusal


def test_an_edit_model_refuses_a_generation_from_text_alone(edit_validator):
    request = ImageGenerationRequest.model_validate({"prompt": "a red circle"})
    with pytest.raises(ApiError) as info:
        edit_validator.generation(request, "req_1", 0.0, EDIT_DIT)
    assert (info.value.status, info.value.param) == (400, "image")


@pytest.mark.parametrize("typed", ["<|image_pad|>", "<|vision_start|>", "<|video_pad|>"])
def test_a_prompt_typing_a_vision_token_is_refused_naming_the_prompt(edit_validator, typed):
    refusal = refused_edit(edit_validator, (96, 64), prompt=f"see {typed}")
    assert refusal.param == "prompt" and typed in refusal.message


def test_size_auto_is_the_listed_size_nearest_the_pictures_where_the_dit_lists_sizes(edit_validator):
    listed = EDIT_DIT.model_copy(
        update={
            "limits": EDIT_DIT.limits.model_copy(
                update={"sizes": ["1024x1024", "1184x896", "896x1184"], "max_pixels": 1184 * 1184}
            )
        }
    )
    form = EditForm(edit_request(size="auto"), [Upload("a.png", png(1600, 1150))], None)
    valid = asyncio.run(edit_validator.edit(form, "req_1", 0.0, listed))
    assert (valid.generation.diffusion.width, valid.generation.diffusion.height) == (1184, 896)
    valid.release()
