"""End to end through the official ``openai`` client (strict response validation), real servers
on loopback: AR (vLLM) → streamed handoff → DiT (diffusers) → OpenAI-shaped answers."""

from __future__ import annotations

import base64
import io
import uuid
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from PIL import Image

from tests.conftest import ADMIN_TOKEN, API_KEY, OTHER_API_KEY
from tests.e2e.metrics_text import sample

pytestmark = pytest.mark.slow

FAST = {"num_inference_steps": 2}
# Over one CPU block (128 tokens) with the template, so a repeat hits the prefix cache.
LONG_PROMPT = ", ".join(["a quiet harbour at dawn with fishing boats and gulls"] * 14)


def png(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    image.load()
    return image


def test_generate_returns_png_of_requested_size(client):
    result = client.images.generate(
        model="ardit", prompt="a red fox in the snow", size="64x48", extra_body={"seed": 3, **FAST}
    )
    image = png(result.data[0].b64_json)
    assert image.format == "PNG" and image.size == (64, 48)
    assert (
        result.usage.input_tokens > 34
        and result.usage.total_tokens == result.usage.input_tokens + result.usage.output_tokens
    )
    assert result.size == "64x48" and result.output_format == "png"


def test_same_seed_same_bytes_other_seed_other_bytes(client):
    def run(seed):
        r = client.images.generate(prompt="a lighthouse at dusk", size="64x64", extra_body={"seed": seed, **FAST})
        return r.data[0].b64_json

    first, again, other = run(11), run(11), run(12)
    assert first == again
    assert first != other


def test_a_custom_noise_schedule_changes_the_picture_and_a_bad_one_is_a_400(client):
    def run(**extra):
        r = client.images.generate(prompt="a lighthouse at dusk", size="64x64", extra_body={"seed": 5, **extra})
        return r.data[0].b64_json

    # Three steps: Qwen-Image's scheduler stretches every schedule's last sigma to the same terminal value.
    assert run(sigmas=[1.0, 0.9, 0.2]) != run(num_inference_steps=3)
    with pytest.raises(openai.BadRequestError) as info:
        run(sigmas=[0.4, 1.0])
    refusal = info.value.body
    assert isinstance(refusal, dict) and refusal["param"] == "sigmas"


def reused_passes(stack, method: str) -> float:
    return sample(stack.dit.url, "ardit_dit_step_cache_passes_total", method=method, outcome="reused")


def test_a_step_cache_skips_work_in_the_dit_and_one_outside_its_bounds_is_a_400(client, stack):
    def run(step_cache: dict[str, Any]) -> str | None:
        extra = {"seed": 5, "num_inference_steps": 6, "step_cache": step_cache}
        return client.images.generate(prompt="a lighthouse at dusk", size="64x64", extra_body=extra).data[0].b64_json

    before = reused_passes(stack, "taylorseer")
    uncached = run({"method": "none"})
    assert run({"method": "taylorseer", "interval": 2}) != uncached
    assert reused_passes(stack, "taylorseer") > before
    with pytest.raises(openai.BadRequestError) as info:
        run({"method": "first_block", "threshold": 2})
    refusal = info.value.body
    assert isinstance(refusal, dict) and refusal["param"].startswith("step_cache")


def test_extras_take_effect(client):
    base = client.images.generate(prompt="a teapot", size="64x64", extra_body={"seed": 5, **FAST})
    more_steps = client.images.generate(
        prompt="a teapot", size="64x64", extra_body={"seed": 5, "num_inference_steps": 3}
    )
    assert base.data[0].b64_json != more_steps.data[0].b64_json
    generated = client.images.generate(
        prompt="a teapot", size="64x64", extra_body={"seed": 5, "max_new_tokens": 5, **FAST}
    )
    assert generated.usage.output_tokens == 5
    assert generated.data[0].revised_prompt  # the AR's generated text
    cfg = client.images.generate(
        prompt="a teapot",
        size="64x64",
        extra_body={"seed": 5, "guidance_scale": 4.0, "negative_prompt": "blurry", **FAST},
    )
    assert cfg.data[0].b64_json != base.data[0].b64_json
    assert cfg.usage.input_tokens > base.usage.input_tokens  # the negative prompt was encoded too


def test_n_images_with_consecutive_seeds(client):
    both = client.images.generate(prompt="a kite", size="64x64", n=2, extra_body={"seed": 20, **FAST})
    second_alone = client.images.generate(prompt="a kite", size="64x64", extra_body={"seed": 21, **FAST})
    assert len(both.data) == 2
    assert both.data[1].b64_json == second_alone.data[0].b64_json


def test_repeated_prompt_is_served_from_the_prefix_cache(client):
    first = client.images.generate(
        prompt=LONG_PROMPT, size="64x64", extra_body={"seed": 1, "cache_salt": "e2e-repeat", **FAST}
    )
    second = client.images.generate(
        prompt=LONG_PROMPT, size="64x64", extra_body={"seed": 1, "cache_salt": "e2e-repeat", **FAST}
    )
    assert first.usage.model_extra["cached_tokens"] == 0
    assert second.usage.model_extra["cached_tokens"] > 0
    assert second.usage.model_extra["cached_tokens"] == (first.usage.input_tokens - 1) // 128 * 128
    assert first.data[0].b64_json == second.data[0].b64_json


def test_a_repeated_negative_prompt_is_not_encoded_again_and_the_picture_is_the_same(client):
    # Both prompts are under one KV block (128 tokens): the prefix cache holds nothing of them.
    extra = {"seed": 3, "guidance_scale": 3.0, "negative_prompt": f"blurry {uuid.uuid4().hex}", **FAST}

    def ask() -> Any:
        return client.images.generate(prompt="a teapot", size="64x64", extra_body=extra)

    first, again = ask(), ask()
    assert first.usage.model_extra["cached_tokens"] == 0
    assert again.usage.model_extra["cached_tokens"] > 0  # the negative prompt's tokens, kept as rows
    assert again.data[0].b64_json == first.data[0].b64_json


def test_one_tenants_cached_prompts_are_not_another_tenants_cache_hits(client, stack):
    # Each API key has its own prefix cache (salted by the key), even for the same prompt and cache_salt:
    # cached_tokens cannot tell a tenant what another one sent.
    other = OpenAI(base_url=stack.api_base, api_key=OTHER_API_KEY, max_retries=0, timeout=300)
    prompt, extra = LONG_PROMPT + ", tenants", {"seed": 1, "cache_salt": "t", **FAST}

    def ask(tenant: Any) -> Any:
        return tenant.images.generate(prompt=prompt, size="64x64", extra_body=extra)

    first, again, from_another_tenant = ask(client), ask(client), ask(other)
    assert first.usage.model_extra["cached_tokens"] == 0 and again.usage.model_extra["cached_tokens"] > 0
    assert from_another_tenant.usage.model_extra["cached_tokens"] == 0
    assert from_another_tenant.data[0].b64_json == first.data[0].b64_json  # the same picture all the same


def test_url_response_format_serves_the_image_to_whoever_holds_the_url(client, stack):
    result = client.images.generate(
        prompt="a cactus", size="64x64", response_format="url", extra_body={"seed": 2, **FAST}
    )
    url = result.data[0].url
    assert url.startswith(stack.ar.url) and "/v1/images/img_" in url
    fetched = httpx.get(url)  # no API key: the unguessable URL is the capability
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/png"
    assert Image.open(io.BytesIO(fetched.content)).size == (64, 64)
    # A name that was never issued (or has expired) is a JSON 404, with or without a key.
    missing = httpx.get(f"{stack.api_base}/images/img_{'A' * 24}.png")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_a_links_host_is_this_servers_whatever_host_the_request_names(client, stack):
    answer = httpx.post(
        f"{stack.api_base}/images/generations",
        headers={"authorization": f"Bearer {API_KEY}", "host": "evil.example"},
        json={"prompt": "a cactus", "size": "64x64", "response_format": "url", "seed": 2, **FAST},
        timeout=300,
    )
    assert answer.status_code == 200
    assert answer.json()["data"][0]["url"].startswith(f"{stack.ar.url}/v1/images/img_")


def test_with_keys_on_metrics_are_the_operators_not_a_tenants(stack):
    def metrics(token: str | None) -> httpx.Response:
        return httpx.get(f"{stack.ar.url}/metrics", headers={"authorization": f"Bearer {token}"} if token else {})

    for tenant in (None, API_KEY, OTHER_API_KEY):
        refused = metrics(tenant)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_admin_token"
    operator = metrics(ADMIN_TOKEN)
    assert operator.status_code == 200 and "ardit_ar_cache_creation_tokens" in operator.text
    assert httpx.get(f"{stack.ar.url}/healthz").status_code == 200  # the probes stay open


def test_the_newest_generation_fields_are_accepted(client):
    result = client.images.generate(
        prompt="a kite",
        size="64x64",
        safety_identifier="user-hash-1",
        user="legacy-user",
        moderation="low",
        style="vivid",
        complexity="high",
        frame_count=4,
        frame_duration_ms=120,
        svg={"model": "any", "reasoning": {"effort": "low"}},
        quality="low",
        extra_body={"seed": 3, **FAST},
    )
    assert result.safety_identifier == "user-hash-1" and result.quality == "low"
    plain = client.images.generate(prompt="a kite", size="64x64", quality="low", extra_body={"seed": 3, **FAST})
    assert result.data[0].b64_json == plain.data[0].b64_json  # accepted, and nothing here depends on them


def test_jpeg_and_webp_output(client):
    for fmt in ("jpeg", "webp"):
        r = client.images.generate(
            prompt="a boat", size="64x64", output_format=fmt, output_compression=80, extra_body={"seed": 2, **FAST}
        )
        assert Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json))).format == fmt.upper()


def test_streaming_partial_then_completed(client):
    events = list(
        client.images.generate(
            prompt="a lantern",
            size="64x64",
            stream=True,
            partial_images=2,
            extra_body={"seed": 4, "num_inference_steps": 4},
        )
    )
    kinds = [e.type for e in events]
    assert kinds[-1] == "image_generation.completed"
    partials = [e for e in events if e.type == "image_generation.partial_image"]
    assert [p.partial_image_index for p in partials] == [0, 1]
    assert png(partials[0].b64_json).size == (64, 64)
    completed = events[-1]
    assert png(completed.b64_json).size == (64, 64) and completed.usage.input_tokens > 0
    assert {e.size for e in events} == {"64x64"}  # the rendered size: strict mode takes any WIDTHxHEIGHT


def test_partial_images_of_n_images_say_which_image_they_preview(client):
    events = list(
        client.images.generate(
            prompt="a lantern",
            size="64x64",
            n=2,
            stream=True,
            partial_images=2,
            extra_body={"seed": 4, "num_inference_steps": 4},
        )
    )
    partials = [e for e in events if e.type == "image_generation.partial_image"]
    # image_index is ardit's field beside OpenAI's; the strict client keeps it as an extra.
    by_image: dict[int, list[int]] = {}
    for partial in partials:
        by_image.setdefault(getattr(partial, "image_index"), []).append(partial.partial_image_index)  # noqa: B009
    assert by_image == {0: [0, 1], 1: [0, 1]}
    assert [e.type for e in events[-2:]] == ["image_generation.completed"] * 2


def test_models_endpoints(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["ardit"]
    assert client.models.retrieve("ardit").id == "ardit"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("dall-e-9")


def test_request_id_is_echoed_and_logged_by_both_services(stack, caplog):
    from services.request_context import RequestIdLogFilter

    caplog.set_level("INFO")
    caplog.handler.addFilter(RequestIdLogFilter())
    response = httpx.post(
        f"{stack.api_base}/images/generations",
        headers={"authorization": f"Bearer {API_KEY}", "x-request-id": "trace-e2e-42"},
        json={"prompt": "a bell", "size": "64x64", **FAST},
        timeout=300,
    )
    assert response.status_code == 200 and response.headers["x-request-id"] == "trace-e2e-42"
    traced = {r.name for r in caplog.records if getattr(r, "request_id", None) == "trace-e2e-42"}
    assert "ardit.ar.serving" in traced  # the AR's line for this request
    assert any(name.startswith("ardit.dit") for name in traced)  # the DiT's, via the handoff's header
