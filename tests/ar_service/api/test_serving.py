"""The public API's translation layer, without an engine: a request against the DiT's limits."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ar_service.api.edit_form import EditForm, Upload
from ar_service.api.protocol import ImageEditRequest, ImageGenerationRequest
from ar_service.api.serving import STRENGTH_BY_FIDELITY, ImageServing, edit_strength, map_failures
from ar_service.engine.row_channel import RowQueueOverflow
from ar_service.handoff_client import DitBusy, DitRejected, DitUnavailable
from ar_service.image_generation import EditInput, PromptTooLong
from ar_service.input_images import EditPixels
from ar_service.settings import ArSettings
from services.errors import ApiError
from shared.capabilities import DiffusionDefaults, DiffusionLimits, DitCapabilities, DitCapacity
from shared.frames import EditSpec

DIT = DitCapabilities(
    model="qwen-image-tiny",
    description="a test model",
    hidden_size=576,
    conditioning=["qwen_image"],
    limits=DiffusionLimits(
        size_multiple=16,
        max_pixels=256 * 256,
        min_inference_steps=2,
        max_inference_steps=40,
        max_guidance_scale=10.0,
        max_images=4,
        max_conditioning_rows=64,
        output_formats=["png", "jpeg"],
    ),
    defaults=DiffusionDefaults(width=64, height=48, num_inference_steps=12, guidance_scale=1.0),
    capacity=DitCapacity(max_concurrent_handoffs=8, max_pipeline_runs=1, pipeline_queue_size=4),
)


def serving() -> ImageServing:
    settings = ArSettings(max_new_tokens_limit=16)
    return ImageServing(settings, generator=None, store=None, metrics=None, readiness=None)  # type: ignore[arg-type]


def translate(**body: Any):
    request = ImageGenerationRequest.model_validate({"prompt": "a red circle", **body})
    return serving().to_generation(request, "req_1", 0.0, DIT)


def refused(**body: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        translate(**body)
    assert info.value.status == 400
    return info.value


def test_auto_size_steps_and_guidance_are_the_dits_defaults():
    gen = translate()
    d = gen.diffusion
    assert (d.width, d.height, d.num_inference_steps, d.guidance_scale) == (64, 48, 12, 1.0)
    assert gen.negative_prompt is None and gen.max_conditioning_rows == 64


def test_quality_and_explicit_steps_choose_the_steps():
    assert translate(quality="low").diffusion.num_inference_steps == 4
    assert translate(quality="high", num_inference_steps=3).diffusion.num_inference_steps == 3


def test_guidance_over_one_or_a_negative_prompt_turn_on_cfg():
    assert translate(guidance_scale=4.0).negative_prompt == " "
    assert translate(negative_prompt="blurry").negative_prompt == "blurry"


def test_an_unseeded_request_gets_a_seed_derived_from_its_id():
    assert translate().diffusion.seed == translate().diffusion.seed


def test_partial_images_only_travel_when_streaming():
    assert translate(partial_images=2).diffusion.partial_images == 0
    assert translate(partial_images=2, stream=True).diffusion.partial_images == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"size": "40x40"}, "size"),
        ({"size": "512x512"}, "size"),
        ({"n": 5}, "n"),
        ({"num_inference_steps": 1}, "num_inference_steps"),
        ({"num_inference_steps": 41}, "num_inference_steps"),
        ({"guidance_scale": 10.5}, "guidance_scale"),
        ({"output_format": "webp"}, "output_format"),
        ({"output_compression": 50}, "output_compression"),
        ({"background": "transparent"}, "background"),
        ({"max_new_tokens": 17}, "max_new_tokens"),
    ],
)
def test_what_the_dit_cannot_do_is_refused_naming_the_public_param(body, param):
    assert refused(**body).param == param


@pytest.mark.parametrize(
    ("failure", "status", "code"),
    [
        (PromptTooLong("too long", "prompt"), 400, "context_length_exceeded"),
        (DitRejected(422, "bad size", "invalid_diffusion_params", "size"), 400, "invalid_diffusion_params"),
        (DitRejected(422, "wrong model", "conditioning_mismatch", "model"), 502, "conditioning_mismatch"),
        (DitRejected(400, "bad frame", "malformed_frame", None), 502, "malformed_frame"),
        (DitBusy("queue full", "3"), 429, "dit_busy"),
        (DitUnavailable("gone"), 503, "dit_unavailable"),
        (RowQueueOverflow("slow"), 503, "handoff_backpressure"),
    ],
)
def test_failures_below_the_api_map_to_openai_errors(failure, status, code):
    with pytest.raises(ApiError) as info, map_failures():
        raise failure
    assert (info.value.status, info.value.code) == (status, code)
    if status in (429, 503):
        assert int(info.value.headers["Retry-After"]) >= 1


def test_anything_unmapped_passes_through():
    with pytest.raises(KeyError), map_failures():
        raise KeyError("not ours")


def test_the_newest_fields_are_accepted_and_change_nothing_here():
    plain = translate(seed=1)
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
    )
    assert newest.diffusion == plain.diffusion


@pytest.mark.parametrize("fmt", ["gif", "svg"])
def test_output_formats_this_model_cannot_make_are_refused(fmt):
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


def test_an_edit_takes_its_size_from_its_pixels():
    pixels = EditPixels(width=96, height=32, image=bytes(96 * 32 * 3), mask=None)
    request = edit_request(size="auto", n=2)
    gen = serving().to_generation(request, "req_1", 0.0, DIT, EditInput(EditSpec(strength=0.5), pixels))
    assert (gen.diffusion.width, gen.diffusion.height, gen.diffusion.num_images) == (96, 32, 2)
    assert gen.edit is not None and gen.edit.frames == {"image": pixels.image}


def test_an_edit_of_several_images_is_refused_before_anything_else():
    form = EditForm(edit_request(), [Upload("a.png", b"a"), Upload("b.png", b"b")], None)
    with pytest.raises(ApiError) as info:
        asyncio.run(serving().prepare_edit(form, "req_1", 0.0))  # no readiness needed: refused first
    assert (info.value.status, info.value.param, info.value.code) == (400, "image", "unsupported_value")
