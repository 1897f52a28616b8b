"""Qwen-Image-2.1 text to image through the running services, against diffusers' own ``QwenImage21Pipeline`` on the
same weights: the tiny checkpoint ``make checkpoints`` builds in the folder layout that pipeline saves (a Qwen3-VL text
encoder, its processor and no tokenizer/, an RGBA VAE), both services given that folder and nothing else of the
model, in fp32 and in bf16 (judged against the fp32 reference relative to diffusers' own bf16-vs-fp32 error, as
tests/e2e/test_qwen_image_reference.py judges Qwen-Image).

What conditions the DiT equals the pipeline's ``encode_prompt``: its template's token ids, the system message's rows
dropped and the user turn's opening kept, ``hidden_states[-1]`` before the final norm (the pipeline hooks the norm
away), within 5e-5. The pictures equal the pipeline's ``__call__`` with the same seed within 2/255, at the card's
default (no CFG) and with CFG against " ", composited over white: ardit serves opaque pictures of an RGBA model
(``dit_service.image_encoder.opaque``). Its edits are a 400 that says it draws from text only (diffusers 0.42.1
cannot drive them with rows: docs/models.md), ``background: transparent`` a 400 naming it. ``test_the_checks_catch_*``
show that the checks fail on the rows a defect would give: the final norm applied (transformers 5's
``hidden_states[-1]`` without the pipeline's hook) or the user turn's opening dropped too (the whole template prefix,
as Qwen-Image drops it).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from diffusers import QwenImage21Pipeline
from openai import OpenAI
from PIL import Image

from dit_service.conditioning import Conditioning, ConditioningAdapter
from services.checkpoints import QWEN_IMAGE_21_MODEL, default_model_dir
from services.model_card import ModelCard
from shared.handoff_assembler import AssembledHandoff
from tests.conftest import require_checkpoint
from tests.e2e.conftest import pair_on_folder
from tests.support.launched_pair import launched_pair
from tests.support.live_server import LiveServer
from tests.support.reference_checks import check_pixels, check_rows

pytestmark = pytest.mark.slow

FOLDER = default_model_dir(QWEN_IMAGE_21_MODEL)
SIZE, STEPS, SEED = "64x64", 3, 11
PROMPTS = ["a red apple on a table", "一只在雪地里奔跑的红色狐狸 水彩画"]
# The system message's tokens: what the pipeline drops (its ``_drop_idx``); the user turn's opening is 3 more.
SYSTEM_TOKENS, USER_TURN_OPENING = 14, 3


class Recorder:
    """Records each conditioning the DiT builds (the requests here run one at a time)."""

    def __init__(self) -> None:
        self.seen: list[tuple[AssembledHandoff, Conditioning]] = []

    def wrap(self, select):
        def recorded(adapter: ConditioningAdapter, handoff: AssembledHandoff) -> Conditioning:
            conditioning = select(adapter, handoff)
            self.seen.append((handoff, conditioning))
            return conditioning

        return recorded

    def take(self) -> tuple[AssembledHandoff, Conditioning]:
        ((handoff, conditioning),) = self.seen
        self.seen.clear()
        return handoff, conditioning


def unpadded(embeds: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
    assert embeds is not None and mask is not None
    return embeds[0, : int(mask.sum())].float()


@dataclass
class Pair:
    dtype: torch.dtype
    client: OpenAI
    recorder: Recorder
    ar: LiveServer

    def generate(self, prompt: str, **extra: Any) -> tuple[np.ndarray, AssembledHandoff, Conditioning]:
        result = self.client.images.generate(
            prompt=prompt, size=SIZE, extra_body={"seed": SEED, "num_inference_steps": STEPS, **extra}
        )
        assert result.data is not None
        image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json or "")))
        assert image.mode == "RGB" and result.background == "opaque"
        return np.asarray(image), *self.recorder.take()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def pair(request) -> Iterator[Pair]:
    recorder = Recorder()
    with pair_on_folder(FOLDER, request.param, recorder.wrap) as (client, ar):
        yield Pair(getattr(torch, request.param), client, recorder, ar)


@pytest.fixture(scope="module")
def reference() -> dict[torch.dtype, Any]:
    """diffusers' own pipeline in fp32 (the reference) and in bf16 (its own bf16 error)."""
    pipelines = {}
    for dtype in (torch.float32, torch.bfloat16):
        pipeline = QwenImage21Pipeline.from_pretrained(str(require_checkpoint(FOLDER)), dtype=dtype)
        pipeline.set_progress_bar_config(disable=True)
        pipelines[dtype] = pipeline
    return pipelines


def encoded(pipeline: Any, prompt: str) -> torch.Tensor:
    with torch.inference_mode():
        embeds, mask, _ = pipeline.encode_prompt(prompt, device=torch.device("cpu"))
    return embeds[0].float() if mask is None else embeds[0, : int(mask[0].sum())].float()


def drawn(pipeline: Any, **inputs: Any) -> np.ndarray:
    """The pipeline's own RGBA picture of ``inputs`` (a prompt, or rows), over white, as 0-255 RGB."""
    width, height = map(int, SIZE.split("x"))
    with torch.inference_mode():
        rgba = pipeline(
            height=height,
            width=width,
            num_inference_steps=STEPS,
            generator=torch.Generator("cpu").manual_seed(SEED),
            output_type="np",
            **inputs,
        ).images[0]
    assert rgba.shape[-1] == 4  # the VAE decodes RGBA
    alpha = rgba[..., 3:]
    return np.round((rgba[..., :3] * alpha + (1 - alpha)) * 255).astype("uint8")


def rendered(pipeline: Any, prompt: str, **cfg: Any) -> np.ndarray:
    return drawn(pipeline, prompt=prompt, **cfg)


def own_bf16(pair: Pair, reference: dict[torch.dtype, Any], what: Any, *args: Any, **kwargs: Any) -> Any:
    return what(reference[torch.bfloat16], *args, **kwargs) if pair.dtype == torch.bfloat16 else None


def test_the_dit_announces_the_cards_recipe_and_the_ar_reads_rows_by_it(pair):
    engine = pair.ar.app.state.runtime.engine
    dit = pair.ar.call(pair.ar.app.state.runtime.readiness.require())[0]
    assert dit.rows == engine.rows and dit.rows is not None
    assert dit.rows.final_norm is False and dit.rows.dropped_prefix is not None
    assert dit.limits.text_to_image and not dit.limits.edits and dit.limits.max_partial_images == 0


@pytest.mark.parametrize("prompt", PROMPTS, ids=["english", "chinese"])
def test_what_conditions_the_dit_is_what_encode_prompt_gives(pair, reference, prompt):
    _, handoff, conditioning = pair.generate(prompt, cache_salt=f"cold-{pair.dtype}-{PROMPTS.index(prompt)}")
    stream, fp32 = handoff.streams["cond"], reference[torch.float32]
    expected_ids = fp32.processor(text=[fp32.prompt_template_t2i.format(prompt)])["input_ids"][0]
    assert stream.token_ids[: stream.answer_start_index] == expected_ids
    assert stream.prefix_tokens == SYSTEM_TOKENS == fp32._drop_idx
    rows = unpadded(conditioning.prompt_embeds, conditioning.prompt_embeds_mask)
    check_rows(rows, encoded(fp32, prompt), own_bf16(pair, reference, encoded, prompt))


def test_pictures_are_what_the_pipeline_renders_with_the_same_seed_over_white(pair, reference):
    image, handoff, _ = pair.generate(PROMPTS[0])
    assert not handoff.open.diffusion.cfg  # the card's default: the pipeline's true_cfg_scale 1
    check_pixels(image, rendered(reference[torch.float32], PROMPTS[0]), own_bf16(pair, reference, rendered, PROMPTS[0]))


def test_cfg_reads_the_negative_prompt_as_the_pipeline_does(pair, reference):
    image, handoff, conditioning = pair.generate(PROMPTS[0], guidance_scale=4.0)
    assert handoff.open.diffusion.cfg and "uncond" in handoff.streams
    fp32 = reference[torch.float32]
    negative = unpadded(conditioning.negative_prompt_embeds, conditioning.negative_prompt_embeds_mask)
    check_rows(negative, encoded(fp32, " "), own_bf16(pair, reference, encoded, " "))
    cfg = {"true_cfg_scale": 4.0, "negative_prompt": " "}
    check_pixels(image, rendered(fp32, PROMPTS[0], **cfg), own_bf16(pair, reference, rendered, PROMPTS[0], **cfg))


def test_edits_and_a_transparent_background_are_400s_that_say_so(pair):
    picture = io.BytesIO()
    Image.new("RGB", (64, 64), "red").save(picture, format="PNG")
    edited = httpx.post(
        f"{pair.ar.url}/v1/images/edits",
        data={"prompt": PROMPTS[0]},
        files={"image": ("red.png", picture.getvalue(), "image/png")},
        timeout=60,
    )
    assert edited.status_code == 400 and edited.json()["error"]["param"] == "image"
    assert "draws from text only" in edited.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        pair.client.images.generate(prompt=PROMPTS[0], size=SIZE, background="transparent")
    assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "background"
    assert pair.recorder.seen == []


# --- each check fails on what a defect would produce -----------------------------------------------------


def test_the_checks_catch_the_final_norm_or_the_user_turn_dropped_too(reference):
    fp32, bf16 = reference[torch.float32], reference[torch.bfloat16]
    right, own_bf16_rows = encoded(fp32, PROMPTS[0]), encoded(bf16, PROMPTS[0])
    norm = fp32.text_encoder.model.language_model.norm
    with torch.inference_mode():
        wrong = {"final norm applied": norm(right[None])[0], "user turn dropped": right[USER_TURN_OPENING:]}
    reference_picture, own_bf16_picture = rendered(fp32, PROMPTS[0]), rendered(bf16, PROMPTS[0])
    check_pixels(own_bf16_picture, reference_picture, own_bf16_picture)
    for rows in wrong.values():
        with pytest.raises(AssertionError):
            check_rows(rows, right)
        with pytest.raises(AssertionError):
            check_rows(rows, right, diffusers_bf16=own_bf16_rows)
        picture = drawn(fp32, prompt_embeds=rows[None])
        with pytest.raises(AssertionError):
            check_pixels(picture, reference_picture)
        with pytest.raises(AssertionError):
            check_pixels(picture, reference_picture, own_bf16_picture)


def test_make_run_serves_it_given_the_dits_folder_alone(tmp_path):
    folder = require_checkpoint(FOLDER)
    with launched_pair(tmp_path / "launcher.log", folder) as launched:
        card = ModelCard.read(folder).rows
        announced = httpx.get(f"{launched.dit_url}/readyz", timeout=10).json()["capabilities"]
        assert card is not None and announced["rows"] == card.model_dump()
        services = [launched.service("ar_service"), launched.service("dit_service")]
        assert launched.generate(num_inference_steps=STEPS).status_code == 200
    assert launched.launcher.returncode == 0
    assert not any(service.is_running() for service in services)
