"""The edit form as the official client sends it, parsed without an engine: typed fields, files,
nested ``svg[...]`` parts, and OpenAI-shaped refusals."""

from __future__ import annotations

from typing import Any

import httpx2
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from openai import OpenAI

from ar_service.api.edit_form import MAX_IMAGES, read_edit_form
from services.errors import install_error_handlers

PNG = ("a.png", b"\x89PNG image bytes", "image/png")


def app() -> FastAPI:
    api = FastAPI()
    install_error_handlers(api, on_error=lambda error: None)

    @api.post("/v1/images/edits")
    async def edit(request: Request) -> dict[str, Any]:
        form = await read_edit_form(request)
        return {
            "request": form.request.model_dump(exclude_none=True, exclude_defaults=True),
            "images": [(u.filename, u.data.decode("latin-1")) for u in form.images],
            "mask": form.mask.data.decode("latin-1") if form.mask else None,
        }

    return api


@pytest.fixture(scope="module")
def form_echo() -> OpenAI:
    """The official client, talking to an app that answers with the edit form as it parsed it."""
    return OpenAI(base_url="http://testserver/v1", api_key="k", http_client=TestClient(app()), max_retries=0)


def sent(client: OpenAI, **kwargs: Any) -> httpx2.Response:
    """The raw answer to what ``client.images.edit(**kwargs)`` sends (the client's own HTTP library's response)."""
    try:
        response = client.images.with_raw_response.edit(**{"prompt": "a cat", "image": PNG, **kwargs}).http_response
    except openai.APIStatusError as exc:
        response = exc.response
    response.read()  # stream=True answers are read lazily
    return response


def parsed(client: OpenAI, **kwargs: Any) -> dict[str, Any]:
    response = sent(client, **kwargs)
    assert response.status_code == 200, response.text
    return response.json()


def refused(client: OpenAI, **kwargs: Any) -> dict[str, Any]:
    response = sent(client, **kwargs)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


def test_every_field_arrives_typed(form_echo):
    body = parsed(
        form_echo,
        n=2,
        size="64x32",
        quality="high",
        background="opaque",
        input_fidelity="high",
        output_format="webp",
        output_compression=80,
        response_format="url",
        stream=True,
        partial_images=2,
        user="u",
        safety_identifier="s",
        complexity="medium",
        svg={"model": "m", "reasoning": {"effort": "low"}},
        model="ardit",
        extra_body={
            "seed": 7,
            "strength": 0.25,
            "guidance_scale": 3,
            "num_inference_steps": 4,
            "negative_prompt": "blur",
            "max_new_tokens": 2,
            "cache_salt": "c",
            "step_cache": {"method": "first_block", "threshold": 0.25},
        },
    )["request"]
    assert body == {
        "prompt": "a cat",
        "n": 2,
        "size": "64x32",
        "quality": "high",
        "background": "opaque",
        "input_fidelity": "high",
        "output_format": "webp",
        "output_compression": 80,
        "response_format": "url",
        "stream": True,
        "partial_images": 2,
        "user": "u",
        "safety_identifier": "s",
        "complexity": "medium",
        "svg": {"model": "m", "reasoning": {"effort": "low"}},
        "model": "ardit",
        "seed": 7,
        "strength": 0.25,
        "guidance_scale": 3.0,
        "num_inference_steps": 4,
        "negative_prompt": "blur",
        "max_new_tokens": 2,
        "cache_salt": "c",
        "step_cache": {"method": "first_block", "threshold": 0.25},
    }


def test_one_image_or_a_list_and_a_mask(form_echo):
    assert parsed(form_echo)["images"] == [["a.png", "\x89PNG image bytes"]]
    listed = parsed(form_echo, image=[PNG, ("b.png", b"second", "image/png")], mask=("m.png", b"mask", "image/png"))
    assert listed["images"] == [["a.png", "\x89PNG image bytes"], ["b.png", "second"]]
    assert listed["mask"] == "mask"


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"extra_body": {"colour": "red"}}, "colour", "unknown_parameter"),
        ({"n": "two"}, "n", "invalid_value"),
        ({"extra_body": {"n": "2.5"}}, "n", "invalid_value"),
        ({"extra_body": {"stream": "yes"}}, "stream", "invalid_value"),
        ({"extra_body": {"strength": "1.5"}}, "strength", "invalid_value"),
        ({"extra_body": {"strength": "nan"}}, "strength", "invalid_value"),
        ({"input_fidelity": "max"}, "input_fidelity", "invalid_value"),
        # The union's tag is in the name: which method's field it is.
        (
            {"extra_body": {"step_cache": {"method": "taylorseer", "interval": 1}}},
            "step_cache.taylorseer.interval",
            "invalid_value",
        ),
        ({"extra_body": {"step_cache": {"method": "teacache"}}}, "step_cache", "invalid_value"),
        ({"size": "huge"}, "size", "invalid_value"),
        ({"image": [PNG] * (MAX_IMAGES + 1)}, "image", "invalid_value"),
        ({"markup": PNG}, "markup", "unsupported_value"),
        ({"mask": ("m.png", b"x" * ((4 << 20) + 1), "image/png")}, "mask", "image_too_large"),
    ],
)
def test_bad_fields_are_400s_naming_them(form_echo, fields, param, code):
    error = refused(form_echo, **fields)
    assert (error["param"], error["code"]) == (param, code)


def test_an_unknown_parameter_gets_openais_message(form_echo):
    assert refused(form_echo, extra_body={"colour": "red"})["message"] == "Unknown parameter: 'colour'."


def test_an_edit_without_an_image_is_refused():
    http = TestClient(app())
    response = http.post("/v1/images/edits", data={"prompt": "x"}, files={"other": ("o.png", b"x", "image/png")})
    assert response.status_code == 400 and response.json()["error"]["code"] == "unknown_parameter"
    response = http.post("/v1/images/edits", files={"prompt": (None, "x"), "n": (None, "1")})
    assert response.status_code == 400 and response.json()["error"]["param"] == "image"


def test_an_image_sent_as_text_is_refused():
    response = TestClient(app()).post("/v1/images/edits", files={"prompt": (None, "x"), "image": (None, "text")})
    assert response.status_code == 400 and response.json()["error"]["param"] == "image"


def test_a_repeated_field_is_refused():
    response = TestClient(app()).post(
        "/v1/images/edits", files=[("prompt", (None, "x")), ("n", (None, "1")), ("n", (None, "2")), ("image", PNG)]
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


def test_json_is_not_an_edit():
    response = TestClient(app()).post("/v1/images/edits", json={"prompt": "x", "image": "data"})
    assert response.status_code == 400 and "multipart/form-data" in response.json()["error"]["message"]
