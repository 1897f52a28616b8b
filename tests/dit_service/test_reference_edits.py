"""The DiT alone renders a reference edit (Qwen-Image-Edit-2511's ``QwenImageEditPlusPipeline``) as diffusers does.

The DiT service runs in process on the tiny checkpoint ``make checkpoints`` builds in 2511's published layout, in fp32,
and is sent a version-5 handoff as the AR sends one: rows (any seeded rows of the model's width: which rows the AR
reads is the AR's part), the model's row recipe, and the pictures, each at the size the pipeline VAE-encodes it at
(its ``vae_size``). Its picture equals diffusers' own ``__call__`` given the same pictures, rows, size, seed and steps
within 2/255, with one picture and with three, without CFG and with the card's (``true_cfg_scale`` 4 against
negative rows).
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence

import httpx
import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import QwenImageEditPlusPipeline
from PIL import Image

from dit_service.app import create_dit_app
from dit_service.settings import DitSettings
from services.checkpoints import QWEN_IMAGE_EDIT_MODEL, default_model_dir
from services.model_card import QWEN_IMAGE_EDIT_PLUS
from shared.capabilities import DitCapabilities
from shared.frames import EditSpec, PictureSpec, StreamName
from shared.handoff_encoder import HandoffEncoder
from tests.conftest import require_checkpoint
from tests.dit_service.handoff_requests import (
    AR_MODEL,
    TOKEN,
    HandoffAnswer,
    hidden_rows,
    open_frame,
    params,
    post_handoff,
    token_ids,
)
from tests.support.live_server import LiveServer
from tests.support.reference_checks import check_pixels

pytestmark = pytest.mark.slow

FOLDER = default_model_dir(QWEN_IMAGE_EDIT_MODEL)
SIZE, STEPS, SEED = 64, 2, 7
ROWS, NEGATIVE_ROWS = 9, 5


def picture(seed: int, width: int, height: int) -> Image.Image:
    """A small noise picture, sent as the AR sends it: resized to the size the pipeline VAE-encodes it at."""
    small = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))
    reading = QWEN_IMAGE_EDIT_PLUS.reads_pictures
    assert reading is not None
    return small.resize(reading.vae_size(width, height), Image.Resampling.LANCZOS)


ONE = (picture(1, 96, 64),)
THREE = (picture(2, 96, 64), picture(3, 64, 96), picture(4, 80, 80))


@pytest.fixture(scope="module")
def edit_dit() -> Iterator[LiveServer]:
    """The DiT on the folder in fp32, its warm-up kept short (a 64x64 default in 2 steps, at most 4)."""
    settings = DitSettings(
        model_dir=require_checkpoint(FOLDER),
        dtype="float32",
        torch_threads=1,
        handoff_token=TOKEN,
        expected_model=AR_MODEL,
        default_size="64x64",
        default_num_inference_steps=2,
        max_inference_steps=4,
    )
    server = LiveServer(create_dit_app(settings)).start().wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference() -> QwenImageEditPlusPipeline:
    pipeline = QwenImageEditPlusPipeline.from_pretrained(str(require_checkpoint(FOLDER)), dtype=torch.float32)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def announced(server: LiveServer) -> DitCapabilities:
    return DitCapabilities.model_validate(httpx.get(f"{server.url}/readyz").json()["capabilities"])


def reference_edit(
    dit: DitCapabilities,
    pictures: Sequence[Image.Image],
    cond: torch.Tensor,
    uncond: torch.Tensor | None,
    partial_images: int = 0,
) -> list[bytes]:
    """A v5 handoff of a reference edit: open (the model's recipe, one picture spec per picture, no strength), each
    picture's pixels in order, the rows of each stream, close."""
    edit = EditSpec(pictures=[PictureSpec(width=p.width, height=p.height) for p in pictures])
    guidance = 1.0 if uncond is None else 4.0
    diffusion = params(
        width=SIZE,
        height=SIZE,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        seed=SEED,
        partial_images=partial_images,
    )
    uncond_rows = None if uncond is None else uncond.shape[0]
    opened = open_frame(
        cond.shape[0], uncond_rows=uncond_rows, diffusion=diffusion, hidden=dit.row_width, rows=dit.rows, edit=edit
    )
    encoder = HandoffEncoder(opened)
    parts = list(encoder.open_frame())
    for index, sent in enumerate(pictures):
        parts += encoder.pixels("image", index, sent.tobytes())
    streams: dict[StreamName, torch.Tensor] = {"cond": cond} if uncond is None else {"cond": cond, "uncond": uncond}
    ids = {name: token_ids(stream.shape[0], first=100 + 400 * n) for n, (name, stream) in enumerate(streams.items())}
    for name, stream in streams.items():
        parts += encoder.rows(name, 0, ids[name], stream)
    answer_start = {name: stream.shape[0] for name, stream in streams.items()}
    parts += encoder.close(ids, answer_start, cached_tokens=0, cache_creation_tokens=0)
    return [bytes(p) for p in parts]


def diffusers_picture(
    pipeline: QwenImageEditPlusPipeline,
    pictures: Sequence[Image.Image],
    cond: torch.Tensor,
    uncond: torch.Tensor | None,
) -> np.ndarray:
    """diffusers' own ``__call__`` given the same pictures, rows (every one valid), size, seed and steps."""
    guidance: dict[str, object] = {"true_cfg_scale": 1.0}
    if uncond is not None:
        guidance = {
            "true_cfg_scale": 4.0,
            "negative_prompt_embeds": uncond[None],
            "negative_prompt_embeds_mask": torch.ones((1, uncond.shape[0]), dtype=torch.long),
        }
    image = pipeline(
        image=list(pictures),
        prompt_embeds=cond[None],
        prompt_embeds_mask=torch.ones((1, cond.shape[0]), dtype=torch.long),
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        generator=torch.Generator("cpu").manual_seed(SEED),
        output_type="np",
        **guidance,
    ).images[0]
    return (image * 255).round().astype("uint8")


def picture_of(answer: HandoffAnswer) -> np.ndarray:
    assert answer.status == 200, answer.error
    [image] = answer.images
    return np.asarray(Image.open(io.BytesIO(image.data)).convert("RGB"))


@pytest.mark.parametrize("pictures", [ONE, THREE], ids=["one-picture", "three-pictures"])
@pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "the-cards-cfg"])
def test_a_reference_edit_is_what_the_pipeline_renders_from_the_same_pictures_and_rows(
    edit_dit, reference, pictures, cfg
):
    dit = announced(edit_dit)
    cond = hidden_rows(ROWS, seed=3, hidden=dit.row_width)
    uncond = hidden_rows(NEGATIVE_ROWS, seed=4, hidden=dit.row_width) if cfg else None
    answer = post_handoff(edit_dit.url, reference_edit(dit, pictures, cond, uncond))
    check_pixels(picture_of(answer), diffusers_picture(reference, pictures, cond, uncond))


def test_the_edit_model_announces_its_pictures_and_refuses_text_alone_before_any_row(edit_dit):
    """It draws from up to three pictures beside the rows, with no mask and no strength, and nothing from text alone:
    an open without an edit is refused as it arrives, before any row is sent."""
    dit = announced(edit_dit)
    limits = dit.limits
    edits = (limits.text_to_image, limits.max_edit_pictures, limits.edit_mask, limits.edit_strength)
    assert edits == (False, 3, False, False)
    text_alone = open_frame(ROWS, diffusion=params(width=SIZE, height=SIZE), hidden=dit.row_width, rows=dit.rows)
    answer = post_handoff(edit_dit.url, [bytes(p) for p in HandoffEncoder(text_alone).open_frame()])
    assert answer.status == 422 and answer.refusal["code"] == "invalid_diffusion_params"
    assert answer.refusal["param"] == "image"


def test_a_reference_edits_previews_are_of_its_output_latents_alone(edit_dit):
    """The step callback sees the pipeline's output latents, not the pictures' it denoises beside them: each preview
    is a picture of the output size."""
    dit = announced(edit_dit)
    handoff = reference_edit(dit, ONE, hidden_rows(ROWS, seed=3, hidden=dit.row_width), None, partial_images=1)
    answer = post_handoff(edit_dit.url, handoff)
    assert answer.status == 200, answer.error
    assert [frame.partial_image_index for frame in answer.partials] == [0]
    for frame in answer.partials:
        assert Image.open(io.BytesIO(frame.data)).size == (SIZE, SIZE)
    assert picture_of(answer).shape == (SIZE, SIZE, 3)
