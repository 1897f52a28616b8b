"""Image edits end to end through the official ``openai`` client (strict response validation): the
multipart upload on the AR, the image and mask through the handoff, img2img / inpaint on the DiT.

The default DiT is a random tiny Qwen-Image: its VAE does not reproduce images, so what strength
and masks guarantee is measured against that VAE's own round trip, in pixels:
- strength 0: the answer is the input's VAE round trip as the edit pipelines make it (encode, normalise
  the latents, denormalise, decode, in the DiT's dtype), to within one level (fp32 measured at 64-256 px
  on noise and gradients: at most 0.01% of the pixels off by one; hence ROUND_TRIP_TOLERANCE);
- a mask: every pixel outside it is the input's own, exactly (0 levels: the DiT pastes the input
  back outside the mask, as diffusers' apply_overlay does), whatever the VAE does to it.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import threading
import time
from typing import Any

import httpx
import numpy as np
import openai
import psutil
import pytest
import torch
from diffusers import AutoencoderKLQwenImage
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from ar_service.api.edit_form import MAX_IMAGES
from tests.conftest import API_KEY, Stack, dit_settings
from tests.e2e.metrics_text import sample

pytestmark = pytest.mark.slow

FAST = {"num_inference_steps": 2}
SIZE = 64
# Pixel levels (0-255) the service's strength-0 answer may differ from diffusers' own VAE round trip.
ROUND_TRIP_TOLERANCE = 1
SQUARE = (16, 16, 48, 48)  # the masked (repainted) region


def gradient() -> np.ndarray:
    pixels = np.zeros((SIZE, SIZE, 3), np.uint8)
    pixels[..., 0] = np.arange(SIZE)[None, :] * 4
    pixels[..., 1] = np.arange(SIZE)[:, None] * 4
    pixels[..., 2] = 128
    return pixels


def file_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def input_png() -> tuple[str, bytes, str]:
    return ("input.png", file_bytes(Image.fromarray(gradient())), "image/png")


def square_mask(size: tuple[int, int] = (SIZE, SIZE)) -> tuple[str, bytes, str]:
    """OpenAI's mask: opaque everywhere, fully transparent where the image is to be edited."""
    mask = Image.new("RGBA", size, (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), SQUARE)
    return ("mask.png", file_bytes(mask), "image/png")


def inside_square() -> np.ndarray:
    inside = np.zeros((SIZE, SIZE), bool)
    x0, y0, x1, y1 = SQUARE
    inside[y0:y1, x0:x1] = True
    return inside


def pixels_of(b64: str) -> np.ndarray:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    return np.asarray(image.convert("RGB")).astype(int)


def diffusers_round_trip(pixels: np.ndarray) -> np.ndarray:
    """The input through the DiT's VAE and back with plain diffusers (the latent's mode), with the edit pipelines'
    latent normalisation in between, in the DiT's dtype (in bf16 that arithmetic alone moves pixels by ~10 levels)."""
    dtype = getattr(torch, dit_settings().torch_dtype_name)
    vae = AutoencoderKLQwenImage.from_pretrained(str(dit_settings().model_dir / "vae"), dtype=dtype)
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(dtype)
    inverse_std = (1.0 / torch.tensor(vae.config.latents_std)).view(shape).to(dtype)
    processor = VaeImageProcessor(vae_scale_factor=16)
    with torch.no_grad():
        x = processor.preprocess(Image.fromarray(pixels)).unsqueeze(2).to(dtype)
        normalised = (vae.encode(x).latent_dist.mode() - mean) * inverse_std
        decoded = vae.decode(normalised / inverse_std + mean).sample[:, :, 0]
    return np.asarray(processor.postprocess(decoded, output_type="pil")[0]).astype(int)


def test_edit_one_image_returns_an_image_of_its_size(client):
    result = client.images.edit(
        image=input_png(), prompt="make it a sunset", extra_body={"seed": 1, "strength": 0.5, **FAST}
    )
    assert len(result.data) == 1 and pixels_of(result.data[0].b64_json).shape == (SIZE, SIZE, 3)
    assert result.size == f"{SIZE}x{SIZE}" and result.output_format == "png"
    assert result.usage.input_tokens > 0


def test_an_edit_form_carries_a_step_cache_to_the_dit(client):
    def edit(step_cache: dict[str, Any]) -> str | None:
        extra = {"seed": 1, "strength": 1.0, "num_inference_steps": 6, "step_cache": step_cache}
        return client.images.edit(image=input_png(), prompt="make it a sunset", extra_body=extra).data[0].b64_json

    uncached = edit({"method": "none"})
    assert edit({"method": "taylorseer", "interval": 2}) != uncached


def test_image_list_of_one_is_the_same_edit(client):
    one = client.images.edit(image=input_png(), prompt="a red sky", extra_body={"seed": 2, **FAST})
    listed = client.images.edit(image=[input_png()], prompt="a red sky", extra_body={"seed": 2, **FAST})
    assert listed.data[0].b64_json == one.data[0].b64_json


def test_more_than_one_image_is_refused_naming_image(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.images.edit(image=[input_png(), input_png()], prompt="two", extra_body=FAST)
    error_body = info.value.body
    assert isinstance(error_body, dict)
    assert error_body["param"] == "image" and error_body["code"] == "unsupported_value"


def test_strength_zero_returns_the_inputs_vae_round_trip(client):
    result = client.images.edit(image=input_png(), prompt="anything", extra_body={"strength": 0.0, **FAST})
    expected = diffusers_round_trip(gradient())
    assert np.abs(pixels_of(result.data[0].b64_json) - expected).max() <= ROUND_TRIP_TOLERANCE


def test_strength_changes_the_edit(client):
    def edit(strength: float) -> str:
        return (
            client.images.edit(
                image=input_png(), prompt="a storm", extra_body={"seed": 3, "strength": strength, **FAST}
            )
            .data[0]
            .b64_json
        )

    assert edit(0.5) != edit(1.0)


def test_a_mask_keeps_every_pixel_outside_it_and_the_prompt_changes_the_inside(client):
    def edit(prompt: str) -> np.ndarray:
        result = client.images.edit(
            image=input_png(), mask=square_mask(), prompt=prompt, extra_body={"seed": 4, "strength": 1.0, **FAST}
        )
        return pixels_of(result.data[0].b64_json)

    boat, castle = edit("a red boat"), edit("a stone castle on a hill")
    inside = inside_square()
    assert np.abs(boat - gradient())[~inside].max() == 0  # measured tolerance: none
    assert np.abs(castle - gradient())[~inside].max() == 0
    assert np.abs(boat - castle)[inside].max() > 0


def test_input_fidelity_sets_the_default_strength(client):
    def edit(fidelity: str | None = None, strength: float | None = None) -> str:
        fields = {"input_fidelity": fidelity} if fidelity else {}
        extra = {"strength": strength} if strength is not None else {}
        result = client.images.edit(
            image=input_png(), prompt="snow", extra_body={"seed": 5, "num_inference_steps": 10, **extra}, **fields
        )
        return result.data[0].b64_json

    low, high = edit("low"), edit("high")
    assert low == edit(strength=0.6) == edit()
    assert high == edit(strength=0.3)
    assert low != high


def test_streamed_edit_events_parse_in_strict_mode(client):
    events = list(
        client.images.edit(
            image=input_png(),
            mask=square_mask(),
            prompt="a lantern",
            stream=True,
            partial_images=2,
            extra_body={"seed": 6, "strength": 1.0, "num_inference_steps": 4},
        )
    )
    assert [e.type for e in events] == ["image_edit.partial_image"] * 2 + ["image_edit.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    completed = events[-1]
    # The rendered size, never "auto": the client's types take any WIDTHxHEIGHT string.
    assert {e.size for e in events} == {f"{SIZE}x{SIZE}"} and completed.usage.input_tokens > 0
    inside = inside_square()
    for event in events:  # previews keep the unmasked pixels too
        assert np.abs(pixels_of(event.b64_json) - gradient())[~inside].max() == 0


def test_size_auto_is_the_inputs_and_a_named_size_resizes(client):
    wide = ("wide.png", file_bytes(Image.fromarray(np.zeros((48, 96, 3), np.uint8))), "image/png")
    auto = client.images.edit(image=wide, prompt="a field", extra_body={"seed": 7, **FAST})
    assert pixels_of(auto.data[0].b64_json).shape == (48, 96, 3) and auto.size == "96x48"
    named = client.images.edit(image=wide, prompt="a field", size="64x32", extra_body={"seed": 7, **FAST})
    assert pixels_of(named.data[0].b64_json).shape == (32, 64, 3)


def test_jpeg_and_webp_inputs_and_outputs(client):
    for fmt in ("JPEG", "WEBP"):
        image = (f"input.{fmt.lower()}", file_bytes(Image.fromarray(gradient()), fmt), f"image/{fmt.lower()}")
        result = client.images.edit(image=image, prompt="x", output_format="jpeg", extra_body={"seed": 8, **FAST})
        assert Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).format == "JPEG"


def test_newest_edit_fields_are_accepted(client):
    result = client.images.edit(
        image=input_png(),
        prompt="x",
        n=1,
        quality="low",
        background="opaque",
        input_fidelity="high",
        output_compression=None,
        response_format="b64_json",
        safety_identifier="user-hash-1",
        user="legacy-user",
        complexity="low",
        svg={"model": "any", "reasoning": {"effort": "low"}},
        model="ardit",
        extra_body={"seed": 9, **FAST},
    )
    assert result.safety_identifier == "user-hash-1" and result.quality == "low"


# --- bad uploads: an OpenAI-shaped 400 before any engine or DiT work --------------------------


def work_done(stack: Stack) -> tuple[float, float]:
    """Prompt tokens the engine took and handoff frames the AR sent, so far."""
    return (
        sample(stack.ar.url, "ardit_ar_prompt_tokens_total"),
        sample(stack.ar.url, "ardit_ar_handoff_sent_frames_total"),
    )


def refused(client, stack: Stack, **kwargs) -> dict:
    before = work_done(stack)
    with pytest.raises(openai.BadRequestError) as info:
        client.images.edit(prompt="x", **{"extra_body": FAST, **kwargs})
    assert work_done(stack) == before
    body = info.value.body
    assert isinstance(body, dict)
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
    return body


def test_not_an_image_is_refused(client, stack):
    body = refused(client, stack, image=("notes.png", b"these are not pixels", "image/png"))
    assert (body["param"], body["code"]) == ("image", "invalid_image_format")


def test_a_corrupt_png_is_refused(client, stack):
    png = input_png()[1]
    body = refused(client, stack, image=("cut.png", png[: len(png) // 2], "image/png"))
    assert (body["param"], body["code"]) == ("image", "invalid_image_format")


def test_a_gif_is_not_an_accepted_input(client, stack):
    body = refused(client, stack, image=("x.gif", file_bytes(Image.fromarray(gradient()), "GIF"), "image/gif"))
    assert body["param"] == "image"


def test_a_decompression_bomb_is_refused_before_it_is_decoded(client, stack):
    # 20,000 x 20,000 zero pixels compress to about 1 MB; decoded they would be 1.2 GB.
    bomb = Image.new("L", (20_000, 20_000))
    body = refused(client, stack, image=("bomb.png", file_bytes(bomb), "image/png"))
    assert (body["param"], body["code"]) == ("image", "image_too_large")


def test_four_thin_images_at_once_are_400s_before_anything_is_decoded(stack):
    # A tall, thin PNG at the input cap (1 x 16,777,216 pixels, about 50 KB): with size=auto its output would
    # be one size multiple wide and far over the DiT's pixel limit. The AR's RSS is the test process's here.
    thin = file_bytes(Image.new("RGB", (1, stack.settings.max_edit_input_pixels)))
    assert len(thin) < 100_000
    process = psutil.Process()
    before, peak, done = process.memory_info().rss, [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.01)

    def edit(_: int) -> httpx.Response:
        return httpx.post(
            f"{stack.api_base}/images/edits",
            headers={"authorization": f"Bearer {API_KEY}"},
            data={"prompt": "taller", "size": "auto"},
            files={"image": ("thin.png", thin, "image/png")},
            timeout=60,
        )

    watcher = threading.Thread(target=watch)
    watcher.start()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(edit, range(4)))
    done.set()
    watcher.join()
    for answer in answers:
        assert answer.status_code == 400, answer.text
        assert (answer.json()["error"]["param"], answer.json()["error"]["code"]) == ("image", "invalid_image_size")
    grew = (peak[0] - before) / 2**20
    assert grew < 100, f"RSS grew {grew:.0f} MB"
    print(f"thin PNG x4: statuses {[a.status_code for a in answers]}, peak RSS +{grew:.1f} MB")


def test_too_many_images_are_refused(client, stack):
    body = refused(client, stack, image=[input_png()] * (MAX_IMAGES + 1))
    assert body["param"] == "image"


def test_a_mask_of_another_size_is_refused(client, stack):
    body = refused(client, stack, image=input_png(), mask=square_mask((32, 32)))
    assert (body["param"], body["code"]) == ("mask", "invalid_image_size")


def test_a_mask_without_alpha_is_refused(client, stack):
    opaque = ("mask.png", file_bytes(Image.new("RGB", (SIZE, SIZE))), "image/png")
    body = refused(client, stack, image=input_png(), mask=opaque)
    assert (body["param"], body["code"]) == ("mask", "invalid_image_format")


def test_an_unknown_form_field_is_openais_unknown_parameter(client, stack):
    body = refused(client, stack, image=input_png(), extra_body={"colour": "red", **FAST})
    assert (body["param"], body["code"], body["message"]) == (
        "colour",
        "unknown_parameter",
        "Unknown parameter: 'colour'.",
    )


def test_a_body_over_the_edit_cap_is_a_413_before_it_is_read(stack):
    cap = stack.settings.max_edit_body_bytes
    response = httpx.post(
        f"{stack.api_base}/images/edits",
        headers={"authorization": f"Bearer {API_KEY}", "content-type": "multipart/form-data; boundary=x"},
        content=b"x" * (cap + 1),
        timeout=60,
    )
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_variations_are_a_clear_404(client):
    # The client marks create_variation deprecated (DALL·E 2 only).
    with pytest.raises(openai.NotFoundError) as info, pytest.deprecated_call():
        client.images.create_variation(image=input_png())
    error_body = info.value.body
    assert isinstance(error_body, dict)
    assert error_body["code"] == "unsupported_endpoint" and "edits" in error_body["message"]


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/images/other"), ("GET", "/v1/nothing")])
def test_every_unknown_path_is_a_json_404(stack, method, path):
    response = httpx.request(method, f"{stack.ar.url}{path}", headers={"authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [("GET", "/v1/images/generations", "POST"), ("PUT", "/v1/images/edits", "POST"), ("DELETE", "/v1/models", "GET")],
)
def test_a_wrong_method_on_a_real_route_is_a_json_405_naming_the_one_allowed(stack, method, path, allowed):
    response = httpx.request(method, f"{stack.ar.url}{path}", headers={"authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 405 and response.headers["allow"] == allowed
    error = response.json()["error"]
    assert error["code"] == "method_not_allowed" and error["message"].startswith(f"{method} is not allowed on {path}")
