"""Z-Image's edits through the running services and the official client, against diffusers' own
``ZImageImg2ImgPipeline`` (a picture noised to a strength) and ``ZImageInpaintPipeline`` (with OpenAI's mask) on the
same weights: the tiny checkpoint ``make checkpoints`` builds in Z-Image's published layout, both services given that
folder and nothing else, at its defaults (guidance 0), in fp32 and in bf16 (judged against the fp32 reference
relative to diffusers' own bf16-vs-fp32 error, as every reference test here).

The pictures equal the pipelines' ``__call__`` with the same picture, mask, prompt, seed and strength within 2/255
(the inpaint pipeline repaints under the mask and pastes nothing back, so neither does ardit for it).
``test_the_checkpoint_*`` shows the tiny checkpoint tells what the checks must tell (another picture, the mask, a
strength step: > 10/255); ``test_the_checks_catch_*`` that they fail on the nearest plausible mistakes (another
picture of the same size, the mask shifted by one pixel or inverted, strength off by 0.1) by several times the
tolerance. A strength that runs no step is a 400 naming it, as the pipelines refuse it.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from diffusers import ZImageImg2ImgPipeline, ZImageInpaintPipeline
from openai import OpenAI
from PIL import Image

from services.checkpoints import Z_IMAGE_MODEL, default_model_dir
from tests.conftest import require_checkpoint
from tests.e2e.conftest import pair_on_folder
from tests.support.edit_pictures import SIZE, edited, loaded, picture, png, repaint_mask
from tests.support.live_server import LiveServer
from tests.support.reference_checks import FP32_PIXELS, check_pixels

pytestmark = pytest.mark.slow

FOLDER = default_model_dir(Z_IMAGE_MODEL)
# 10 steps, so that strength 0.1 apart runs another number of steps (at 4, 0.6 and 0.7 both run 3); 0.4, so that the
# picture shows through Z-Image's shifted schedule (measured on the pipeline, levels mean/max: another picture 4.5/62,
# strength 0.1 off 5.0/68 and 7.5/75, the mask shifted a pixel 25/247, against a bf16 error of 0.6/8).
STEPS, SEED, STRENGTH = 10, 5, 0.4
PROMPT = "a red fox in the snow"
LEVELS = 10  # of 255: the least change a test may tell from noise


@dataclass
class Pair:
    dtype: torch.dtype
    client: OpenAI
    ar: LiveServer

    def edit(self, image: Image.Image, mask: np.ndarray | None = None, **extra: Any) -> np.ndarray:
        fields = {"seed": SEED, "num_inference_steps": STEPS, "strength": STRENGTH, **extra}
        return edited(self.client, [image], PROMPT, mask, f"{SIZE}x{SIZE}", fields)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def pair(request) -> Iterator[Pair]:
    with pair_on_folder(FOLDER, request.param, lambda select: select) as (client, ar):
        yield Pair(getattr(torch, request.param), client, ar)


@pytest.fixture(scope="module")
def reference() -> dict[tuple[str, torch.dtype], Any]:
    """diffusers' own img2img and inpaint pipelines in fp32 (the reference) and bf16 (their own bf16 error)."""
    return loaded(require_checkpoint(FOLDER), {"img2img": ZImageImg2ImgPipeline, "inpaint": ZImageInpaintPipeline})


def rendered(
    reference: dict[tuple[str, torch.dtype], Any],
    image: Image.Image,
    mask: np.ndarray | None = None,
    strength: float = STRENGTH,
    dtype: torch.dtype = torch.float32,
) -> np.ndarray:
    """The pipeline's own picture: the card's guidance (0), the same seed and steps; the mask as diffusers reads one
    (white repaints)."""
    kind = "img2img" if mask is None else "inpaint"
    extra = {} if mask is None else {"mask_image": Image.fromarray(np.where(mask, 255, 0).astype(np.uint8))}
    with torch.inference_mode():
        out = reference[kind, dtype](
            prompt=PROMPT,
            image=image,
            strength=strength,
            height=SIZE,
            width=SIZE,
            num_inference_steps=STEPS,
            guidance_scale=0.0,
            generator=torch.Generator("cpu").manual_seed(SEED),
            output_type="np",
            **extra,
        ).images[0]
    return np.round(out * 255).astype("uint8")


def own_bf16(
    pair: Pair,
    reference: dict[tuple[str, torch.dtype], Any],
    image: Image.Image,
    mask: np.ndarray | None = None,
    strength: float = STRENGTH,
) -> np.ndarray | None:
    """diffusers' own bf16 picture, where the pair runs bf16 (its error is the bound); else None."""
    if pair.dtype != torch.bfloat16:
        return None
    return rendered(reference, image, mask, strength, dtype=torch.bfloat16)


def levels(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


def test_z_image_announces_one_picture_a_mask_and_a_strength(pair):
    dit = pair.ar.call(pair.ar.app.state.runtime.readiness.require())[0]
    limits = dit.limits
    assert (limits.edits, limits.max_edit_pictures, limits.edit_mask, limits.edit_strength) == (True, 1, True, True)
    assert limits.edits_without_steps is False


def test_an_edit_without_a_mask_is_what_img2img_renders(pair, reference):
    image = pair.edit(picture(1))
    check_pixels(image, rendered(reference, picture(1)), own_bf16(pair, reference, picture(1)))


def test_an_edit_with_openais_mask_is_what_inpaint_renders(pair, reference):
    mask = repaint_mask()
    image = pair.edit(picture(1), mask)
    check_pixels(image, rendered(reference, picture(1), mask), own_bf16(pair, reference, picture(1), mask))


def test_input_fidelity_high_is_the_strength_ardit_maps_it_to(pair, reference):
    from ar_service.api.validation import STRENGTH_BY_FIDELITY

    image = pair.edit(picture(2), strength=None, input_fidelity="high")
    strength = STRENGTH_BY_FIDELITY["high"]
    check_pixels(
        image,
        rendered(reference, picture(2), strength=strength),
        own_bf16(pair, reference, picture(2), strength=strength),
    )


def test_a_strength_that_runs_no_step_is_a_400_naming_it_and_the_next_edit_renders(pair):
    with pytest.raises(openai.BadRequestError) as refused:
        pair.edit(picture(1), strength=0.0)  # diffusers' loop would run no step
    assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "strength"
    assert "runs no step" in refused.value.body["message"]
    assert pair.edit(picture(1), strength=0.01).shape == (SIZE, SIZE, 3)  # one step of 10 runs


def test_an_edit_streams_its_previews_then_the_picture_img2img_renders(pair, reference):
    streamed = httpx.post(
        f"{pair.ar.url}/v1/images/edits",
        data={
            "prompt": PROMPT,
            "size": f"{SIZE}x{SIZE}",
            "stream": "true",
            "partial_images": "2",
            "seed": str(SEED),
            "num_inference_steps": str(STEPS),
            "strength": str(STRENGTH),
        },
        files={"image": ("in.png", png(picture(1)), "image/png")},
        timeout=120,
    )
    assert streamed.status_code == 200
    events = [line.removeprefix("event: ") for line in streamed.text.splitlines() if line.startswith("event: ")]
    assert events == ["image_edit.partial_image"] * 2 + ["image_edit.completed"]
    data = [line.removeprefix("data: ") for line in streamed.text.splitlines() if line.startswith("data: ")]
    final = json.loads(data[-1])["b64_json"]
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(final))).convert("RGB"))
    check_pixels(image, rendered(reference, picture(1)), own_bf16(pair, reference, picture(1)))


def test_a_mask_of_another_size_is_a_400_naming_it(pair):
    other = Image.new("RGBA", (SIZE, SIZE + 8), (0, 0, 0, 0))
    answer = httpx.post(
        f"{pair.ar.url}/v1/images/edits",
        data={"prompt": PROMPT},
        files={"image": ("in.png", png(picture(1)), "image/png"), "mask": ("m.png", png(other), "image/png")},
        timeout=60,
    )
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "mask"


# --- the checkpoint can tell, and the checks do ----------------------------------------------------------


def test_the_checkpoint_tells_another_picture_the_mask_and_a_strength_step(reference):
    edited = rendered(reference, picture(1))
    assert levels(edited, rendered(reference, picture(3))) > LEVELS
    assert levels(edited, rendered(reference, picture(1), repaint_mask())) > LEVELS
    assert levels(edited, rendered(reference, picture(1), strength=STRENGTH + 0.1)) > LEVELS


def test_the_checks_catch_another_picture_a_shifted_or_inverted_mask_and_strength_off_by_a_tenth(reference):
    mask = repaint_mask()
    right = rendered(reference, picture(1), mask)
    right_bf16 = rendered(reference, picture(1), mask, dtype=torch.bfloat16)
    check_pixels(right_bf16, right, right_bf16)
    wrong = {
        "another picture": rendered(reference, picture(3), mask),
        "mask shifted a pixel": rendered(reference, picture(1), repaint_mask(shift=1)),
        "mask inverted": rendered(reference, picture(1), repaint_mask(inverted=True)),
        "strength + 0.1": rendered(reference, picture(1), mask, strength=STRENGTH + 0.1),
        "strength - 0.1": rendered(reference, picture(1), mask, strength=STRENGTH - 0.1),
    }
    for name, candidate in wrong.items():
        assert levels(candidate, right) >= 3 * FP32_PIXELS, name
        with pytest.raises(AssertionError):
            check_pixels(candidate, right)
        with pytest.raises(AssertionError):
            check_pixels(candidate, right, right_bf16)
