"""Qwen-Image-Edit-2511 through the running services, against diffusers' own ``QwenImageEditPlusPipeline`` on the same
weights: the tiny checkpoint ``make checkpoints`` builds in 2511's published layout (Qwen2.5-VL with its vision tower,
its processor, a ``zero_cond_t`` transformer), both services given that folder and nothing else of the model, edits
sent by the official client as ``image[]``.

The encoder reads the pictures. What conditions the DiT is the text encoder's ``hidden_states[-1]`` of the pipeline's
prompt and condition pictures, the 64-token system prefix dropped, with the model's 3-D M-RoPE positions: diffusers
0.42.1's ``encode_prompt`` does not pass the processor's ``mm_token_type_ids`` to its encoder (huggingface/diffusers
#14194, fixed by #14189), so the reference rows here are ``encode_prompt``'s steps with that one argument passed, as
the fix passes it (docs/picture_encoders.md). The pictures equal ``__call__`` given those rows, the same pictures,
seed and steps, with one and with three pictures, with the card's CFG (``true_cfg_scale`` 4 against " ", whose rows
read the same pictures) and without. ``test_the_checks_catch_*`` show each comparison fails on the nearest mistake.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import openai
import psutil
import pytest
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
    CONDITION_IMAGE_SIZE,
    QwenImageEditPlusPipeline,
    calculate_dimensions,
)
from openai import OpenAI
from PIL import Image

from services.checkpoints import QWEN_IMAGE_EDIT_MODEL, default_model_dir
from services.model_card import QWEN_IMAGE_EDIT_PLUS
from tests.ar_service.test_input_images import png_header_only
from tests.conftest import require_checkpoint
from tests.e2e.conftest import pair_on_folder
from tests.e2e.test_qwen_image_reference import Recorder, Seen
from tests.support.reference_checks import check_pixels, check_rows

pytestmark = pytest.mark.slow

FOLDER = default_model_dir(QWEN_IMAGE_EDIT_MODEL)
CARD = QWEN_IMAGE_EDIT_PLUS
assert CARD.reads_pictures is not None
READING = CARD.reads_pictures
SIZE, STEPS, SEED = "64x64", 3, 11
PROMPT = "turn the sky into a sunset"
VISION_END = 151653  # <|vision_end|>, after each picture's tokens


def picture(seed: int, width: int = 96, height: int = 64) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


ONE = (picture(1),)
THREE = (picture(2), picture(3, 64, 96), picture(4, 80, 80))


@dataclass
class Pair:
    dtype: torch.dtype
    client: OpenAI
    recorder: Recorder

    def edit(self, images: Sequence[Image.Image], **extra) -> tuple[np.ndarray, Seen, dict]:
        result = self.client.images.edit(
            image=[(f"p{n}.png", png(image), "image/png") for n, image in enumerate(images)],
            prompt=extra.pop("prompt", PROMPT),
            size=SIZE,
            extra_body={"seed": SEED, "num_inference_steps": STEPS, **extra},
        )
        assert result.data is not None
        image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json or "")))
        usage = result.usage.model_dump() if result.usage is not None else {}
        return np.asarray(image.convert("RGB")), self.recorder.take(), usage


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def pair(request) -> Iterator[Pair]:
    recorder = Recorder()
    with pair_on_folder(FOLDER, request.param, recorder.wrap) as (client, _):
        yield Pair(getattr(torch, request.param), client, recorder)


@pytest.fixture(scope="module")
def reference() -> dict[torch.dtype, QwenImageEditPlusPipeline]:
    pipelines = {}
    for dtype in (torch.float32, torch.bfloat16):
        pipeline = QwenImageEditPlusPipeline.from_pretrained(str(require_checkpoint(FOLDER)), dtype=dtype)
        pipeline.set_progress_bar_config(disable=True)
        pipelines[dtype] = pipeline
    return pipelines


def condition_pictures(pipeline: QwenImageEditPlusPipeline, images: Sequence[Image.Image]) -> list[Image.Image]:
    """Each picture as ``__call__`` resizes it for the encoder."""
    sizes = [calculate_dimensions(CONDITION_IMAGE_SIZE, i.width / i.height) for i in images]
    return [pipeline.image_processor.resize(i, h, w) for i, (w, h) in zip(images, sizes, strict=True)]


def encoded(pipeline: QwenImageEditPlusPipeline, prompt: str, images: Sequence[Image.Image]) -> torch.Tensor:
    """``_get_qwen_prompt_embeds``' steps with the processor's ``mm_token_type_ids`` passed on (diffusers#14189)."""
    pictures = condition_pictures(pipeline, images)
    text = pipeline.prompt_template_encode.format(READING.prompt(len(images), prompt))
    inputs = pipeline.processor(text=[text], images=pictures, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = pipeline.text_encoder(**inputs, output_hidden_states=True).hidden_states[-1]
    return hidden[0, pipeline.prompt_template_encode_start_idx :].float()


def rendered(
    pipeline: QwenImageEditPlusPipeline, images: Sequence[Image.Image], guidance: float, prompt: str = PROMPT
) -> np.ndarray:
    dtype = pipeline.transformer.dtype
    rows = encoded(pipeline, prompt, images).to(dtype)[None]
    cfg = {}
    if guidance > 1:
        negative = encoded(pipeline, CARD.default_negative_prompt or "", images).to(dtype)[None]
        cfg = {
            "negative_prompt_embeds": negative,
            "negative_prompt_embeds_mask": torch.ones(negative.shape[:2], dtype=torch.long),
            "true_cfg_scale": guidance,
        }
    width, height = map(int, SIZE.split("x"))
    image = pipeline(
        image=list(images),
        prompt_embeds=rows,
        prompt_embeds_mask=torch.ones(rows.shape[:2], dtype=torch.long),
        height=height,
        width=width,
        num_inference_steps=STEPS,
        generator=torch.Generator("cpu").manual_seed(SEED),
        output_type="np",
        **cfg,
    ).images[0]
    return (image * 255).round().astype("uint8")


@pytest.mark.parametrize("images", [ONE, THREE], ids=["one-picture", "three-pictures"])
def test_what_conditions_the_dit_is_the_encoder_reading_the_pictures(pair, reference, images):
    _, seen, usage = pair.edit(images, guidance_scale=1.0)
    fp32 = reference[torch.float32]
    stream = seen.handoff.streams["cond"]
    text = fp32.prompt_template_encode.format(READING.prompt(len(images), PROMPT))
    expected_ids = fp32.processor(text=[text], images=condition_pictures(fp32, images))["input_ids"][0]
    assert stream.prefix_tokens == fp32.prompt_template_encode_start_idx == 64
    assert stream.token_ids[: stream.answer_start_index] == list(expected_ids)
    pads = list(expected_ids).count(fp32.processor.image_token_id)
    assert usage["input_tokens_details"]["image_tokens"] == pads
    bf16 = encoded(reference[torch.bfloat16], PROMPT, images) if pair.dtype == torch.bfloat16 else None
    check_rows(seen.rows(), encoded(fp32, PROMPT, images), bf16)


@pytest.mark.parametrize("images", [ONE, THREE], ids=["one-picture", "three-pictures"])
@pytest.mark.parametrize("guidance", [1.0, None], ids=["no-cfg", "the-models-cfg"])
def test_pictures_are_what_the_pipeline_renders_from_the_same_pictures_and_seed(pair, reference, images, guidance):
    asked = {} if guidance is None else {"guidance_scale": guidance}
    image, seen, _ = pair.edit(images, **asked)
    scale = (CARD.default_guidance_scale or 1.0) if guidance is None else guidance
    assert seen.handoff.open.diffusion.guidance_scale == scale
    bf16 = rendered(reference[torch.bfloat16], images, scale) if pair.dtype == torch.bfloat16 else None
    check_pixels(image, rendered(reference[torch.float32], images, scale), bf16)


@pytest.mark.parametrize("pair", ["float32"], indirect=True)
def test_the_same_picture_with_another_instruction_hits_the_cache_and_renders_as_cold(pair):
    image = (picture(21),)
    salt = "same-picture"
    _, first, _ = pair.edit(image, prompt="make it snow", guidance_scale=1.0, cache_salt=salt)
    cold_image, cold, cold_usage = pair.edit(image, prompt="make it rain", guidance_scale=1.0, cache_salt=salt + "2")
    hit_image, hit, hit_usage = pair.edit(image, prompt="make it rain", guidance_scale=1.0, cache_salt=salt)
    first_ids, hit_ids = (seen.handoff.streams["cond"].token_ids for seen in (first, hit))
    shared = next(n for n, (a, b) in enumerate(zip(first_ids, hit_ids, strict=False)) if a != b)
    picture_end = max(n for n, token in enumerate(hit_ids) if token == VISION_END) + 1
    # Every whole 128-token block of the shared system prompt, picture and words ("make it "), and no more.
    assert cold_usage["cached_tokens"] == 0 and hit_usage["cached_tokens"] == shared // 128 * 128
    assert picture_end // 128 * 128 <= hit_usage["cached_tokens"] and picture_end > 128
    assert torch.equal(hit.rows(), cold.rows()) and np.array_equal(hit_image, cold_image)


# --- each check fails on what a defect would produce -----------------------------------------------------


def test_the_checks_catch_another_picture_in_the_encoder_or_in_the_latents(reference):
    """Another picture of the same size read by the encoder (the rows), or VAE-encoded beside right rows (the
    pictures): each fails the fp32 and the bf16 check."""
    fp32, bf16 = reference[torch.float32], reference[torch.bfloat16]
    other = (picture(99),)
    with pytest.raises(AssertionError):
        check_rows(encoded(fp32, PROMPT, other), encoded(fp32, PROMPT, ONE))
    right = rendered(fp32, ONE, 1.0)
    dtype = fp32.transformer.dtype
    rows = encoded(fp32, PROMPT, ONE).to(dtype)[None]
    other_latents = fp32(
        image=list(other),
        prompt_embeds=rows,
        prompt_embeds_mask=torch.ones(rows.shape[:2], dtype=torch.long),
        height=64,
        width=64,
        num_inference_steps=STEPS,
        generator=torch.Generator("cpu").manual_seed(SEED),
        output_type="np",
    ).images[0]
    wrong = (other_latents * 255).round().astype("uint8")
    for check in (lambda: check_pixels(wrong, right), lambda: check_pixels(wrong, right, rendered(bf16, ONE, 1.0))):
        with pytest.raises(AssertionError):
            check()


# --- bad input loses nothing ------------------------------------------------------------------------------


@pytest.mark.parametrize("pair", ["float32"], indirect=True)
def test_bad_pictures_are_400s_naming_image_and_the_next_edit_renders_as_before(pair, reference):
    good = png(ONE[0])
    bad = {
        "not an image": [("a.png", b"not a picture", "image/png")],
        "a truncated picture": [("a.png", good[: len(good) // 2], "image/png")],
        "four pictures": [(f"{n}.png", good, "image/png") for n in range(4)],
        "over the pixel cap": [("a.png", png_header_only(5000, 5000), "image/png")],
    }
    for files in bad.values():
        with pytest.raises(openai.BadRequestError) as refused:
            pair.client.images.edit(image=files, prompt=PROMPT, size=SIZE, extra_body={"num_inference_steps": STEPS})
        assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "image"
    image, _, _ = pair.edit(ONE, guidance_scale=1.0)
    check_pixels(image, rendered(reference[torch.float32], ONE, 1.0))


@pytest.mark.parametrize("pair", ["float32"], indirect=True)
def test_the_ars_memory_stays_flat_over_200_refused_pictures(pair):
    """The AR runs in this process: its RSS is the test's. Refusals are decided on headers, nothing decoded."""
    files = [(f"{n}.png", png(ONE[0]), "image/png") for n in range(4)]
    bomb = [("a.png", png_header_only(5000, 5000), "image/png")]

    def refuse(times: int) -> None:
        for n in range(times):
            with pytest.raises(openai.BadRequestError):
                pair.client.images.edit(image=files if n % 2 else bomb, prompt=PROMPT, size=SIZE)

    refuse(20)  # warm-up: the first requests allocate what every request reuses
    before = psutil.Process().memory_info().rss
    refuse(200)
    grew = (psutil.Process().memory_info().rss - before) / 2**20
    assert grew < 20, f"RSS grew {grew:.1f} MB over 200 refused edits"
