"""The public request model: OpenAI's fields, ardit's extras, strict types, unknown fields refused."""

from __future__ import annotations

import pytest
from openai.types.image_edit_params import ImageEditParamsBase
from openai.types.image_generate_params import ImageGenerateParamsBase
from pydantic import ValidationError

from ar_service.api.edit_form import FILE_PARTS
from ar_service.api.protocol import ImageEditRequest, ImageGenerationRequest


def parse(**body):
    return ImageGenerationRequest.model_validate({"prompt": "x", **body})


@pytest.mark.parametrize(
    "body",
    [
        {"stream": "yes"},
        {"seed": True},
        {"n": "2"},
        {"size": "\u00b256x256"},  # a digit to str.isdigit, not to int()
        {"size": "1" * 4301 + "x16"},
        {"size": "256"},
        {"unknown_field": 1},
    ],
)
def test_loose_or_unknown_input_is_refused(body):
    with pytest.raises(ValidationError):
        parse(**body)


def test_numbers_are_json_numbers():
    assert parse(guidance_scale=4).guidance_scale == 4.0
    assert parse(n=2.0).n == 2  # an integer to JSON Schema
    with pytest.raises(ValidationError):
        parse(n=2.5)
    with pytest.raises(ValidationError):
        parse(guidance_scale="4")


def test_quality_is_echoed_only_where_openai_echoes_it():
    assert parse(quality="high").echoed_quality == "high"
    assert parse(quality="auto").echoed_quality is None


def test_every_field_of_the_clients_image_generate_params_is_known():
    assert set(ImageGenerateParamsBase.__annotations__) | {"stream"} <= set(ImageGenerationRequest.model_fields)


def test_every_field_of_the_clients_image_edit_params_is_known():
    fields = set(ImageEditRequest.model_fields) | {"stream"} | set(FILE_PARTS)
    assert set(ImageEditParamsBase.__annotations__) <= fields


@pytest.mark.parametrize(
    "body",
    [{"frame_count": "4"}, {"frame_count": 1}, {"complexity": "extreme"}, {"svg": {"model": 3}}, {"svg": {"x": 1}}],
)
def test_the_newest_fields_are_typed_too(body):
    with pytest.raises(ValidationError):
        parse(**body)
