"""The public request model: OpenAI's fields, ardit's extras, strict types, unknown fields refused."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ar_service.api.protocol import ImageGenerationRequest


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
