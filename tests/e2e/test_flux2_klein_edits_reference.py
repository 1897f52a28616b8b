"""FLUX.2 [klein]'s edits through the running services and the official client, against diffusers' own
``Flux2KleinPipeline`` (1 to 4 reference pictures it VAE-encodes itself, no strength) and
``Flux2KleinInpaintPipeline`` (OpenAI's mask on the first picture, a strength, the others as ``image_reference``) on
the same weights: the tiny checkpoint ``make checkpoints`` builds in FLUX.2 [klein]'s published layout, both services
given that folder and nothing else, at its defaults (4 steps, guidance 1), in fp32 and in bf16 (judged against the
fp32 reference relative to diffusers' own bf16-vs-fp32 error, as every reference test here).

The reference is each pipeline given the real rows of its ``encode_prompt`` (FLUX.2's 512-row padding a causal engine
cannot compute: tests/e2e/test_qwen3_families.py), with the same pictures, mask, seed and strength: within 2/255.
``test_the_checkpoint_*`` shows the tiny checkpoint tells what the checks must tell (> 10/255);
``test_the_checks_catch_*`` that they fail on the nearest plausible mistakes (another reference picture of the same
size, the mask shifted by one pixel or inverted, strength off by 0.1) by several times the tolerance. What the
pipelines refuse (a picture under 64 px, a strength without a mask, a fifth picture, a size the inpaint does not
draw) is a 400 naming the field before any work.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import openai
import psutil
import pytest
import torch
from diffusers import Flux2KleinInpaintPipeline, Flux2KleinPipeline
from openai import OpenAI
from PIL import Image

from services.checkpoints import FLUX2_KLEIN_MODEL, default_model_dir
from tests.conftest import require_checkpoint
from tests.e2e.conftest import pair_on_folder
from tests.e2e.test_qwen3_families import FAMILIES, encoded
from tests.support.edit_pictures import SIZE, edited, loaded, picture, png, repaint_mask
from tests.support.live_server import LiveServer
from tests.support.reference_checks import FP32_PIXELS, check_pixels

pytestmark = pytest.mark.slow

FOLDER = default_model_dir(FLUX2_KLEIN_MODEL)
FAMILY = FAMILIES["flux2-klein"]
PROMPT = "a red fox in the snow"
# The card's 4 steps for reference edits; the inpaint's at 10, so that strength 0.1 apart runs another number of steps
# (at 4, 0.6 and 0.7 both run 3).
STEPS, INPAINT_STEPS, SEED, STRENGTH = 4, 10, 5, 0.6
LEVELS = 10  # of 255: the least change a test may tell from noise


@dataclass
class Pair:
    dtype: torch.dtype
    client: OpenAI
    ar: LiveServer

    def edit(
        self, images: list[Image.Image], mask: np.ndarray | None = None, size: str = "auto", **extra: Any
    ) -> np.ndarray:
        steps = INPAINT_STEPS if mask is not None else STEPS
        return edited(self.client, images, PROMPT, mask, size, {"seed": SEED, "num_inference_steps": steps, **extra})


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def pair(request) -> Iterator[Pair]:
    with pair_on_folder(FOLDER, request.param, lambda select: select) as (client, ar):
        yield Pair(getattr(torch, request.param), client, ar)


@pytest.fixture(scope="module")
def reference() -> dict[tuple[str, torch.dtype], Any]:
    """diffusers' own reference-edit and inpaint pipelines in fp32 (the reference) and bf16 (their own bf16 error)."""
    return loaded(require_checkpoint(FOLDER), {"reference": Flux2KleinPipeline, "inpaint": Flux2KleinInpaintPipeline})


def rendered(
    reference: dict[tuple[str, torch.dtype], Any],
    images: list[Image.Image],
    mask: np.ndarray | None = None,
    strength: float = STRENGTH,
    dtype: torch.dtype = torch.float32,
) -> np.ndarray:
    """The pipeline's own picture from the real rows of its ``encode_prompt``: the reference edit's at the first
    picture's size, the inpaint's at its picture's."""
    kind = "reference" if mask is None else "inpaint"
    pipeline = reference[kind, dtype]
    rows = encoded(FAMILY, pipeline, PROMPT)[None].to(dtype)
    inputs: dict[str, Any] = {"image": images}
    if mask is not None:
        inputs = {
            "image": images[0],
            "image_reference": images[1:] or None,
            "mask_image": Image.fromarray(np.where(mask, 255, 0).astype(np.uint8)),
            "strength": strength,
        }
    width, height = images[0].size
    with torch.inference_mode():
        out = pipeline(
            prompt_embeds=rows,
            height=height,
            width=width,
            num_inference_steps=STEPS if mask is None else INPAINT_STEPS,
            guidance_scale=1.0,
            generator=torch.Generator("cpu").manual_seed(SEED),
            output_type="np",
            **inputs,
        ).images[0]
    return np.round(out * 255).astype("uint8")


def own_bf16(
    pair: Pair,
    reference: dict[tuple[str, torch.dtype], Any],
    images: list[Image.Image],
    mask: np.ndarray | None = None,
) -> np.ndarray | None:
    return rendered(reference, images, mask, dtype=torch.bfloat16) if pair.dtype == torch.bfloat16 else None


def levels(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


def test_flux2_announces_up_to_four_pictures_a_mask_and_a_strength_only_with_it(pair):
    limits = pair.ar.call(pair.ar.app.state.runtime.readiness.require())[0].limits
    assert (limits.edits, limits.max_edit_pictures, limits.edit_mask, limits.edit_strength) == (True, 4, True, False)
    assert limits.reference_pictures is not None and limits.reference_pictures.min_side == 64


def test_an_edit_of_one_picture_is_what_the_pipeline_renders_with_it(pair, reference):
    images = [picture(1)]
    check_pixels(pair.edit(images), rendered(reference, images), own_bf16(pair, reference, images))


def test_three_pictures_of_three_sizes_are_read_in_order_and_auto_is_the_first_ones_size(pair, reference):
    images = [picture(1, 96, 64), picture(2), picture(4, 64, 128)]
    edited = pair.edit(images)
    assert edited.shape == (64, 96, 3)
    check_pixels(edited, rendered(reference, images), own_bf16(pair, reference, images))


def test_an_edit_with_openais_mask_is_what_the_inpaint_renders(pair, reference):
    images, mask = [picture(1)], repaint_mask()
    edited = pair.edit(images, mask, strength=STRENGTH)
    check_pixels(edited, rendered(reference, images, mask), own_bf16(pair, reference, images, mask))


def test_a_masked_edit_reads_the_other_pictures_as_references(pair, reference):
    images, mask = [picture(1), picture(2)], repaint_mask()
    edited = pair.edit(images, mask, strength=STRENGTH)
    check_pixels(edited, rendered(reference, images, mask), own_bf16(pair, reference, images, mask))


def test_a_reference_edit_with_taylorseer_is_what_the_pipeline_renders_with_diffusers_own_hook(pair, reference):
    """FLUX.2's one step cache runs on its edits as on its text to image: diffusers' TaylorSeer hook on the
    transformer, whatever pipeline calls it."""
    from diffusers.hooks.taylorseer_cache import TaylorSeerCacheConfig

    images, steps = [picture(1), picture(2)], 6
    edited = pair.edit(images, num_inference_steps=steps, step_cache={"method": "taylorseer", "interval": 2})

    def cached(dtype: torch.dtype, hook: bool = True) -> np.ndarray:
        pipeline = reference["reference", dtype]
        rows = encoded(FAMILY, pipeline, PROMPT)[None].to(dtype)
        if hook:
            pipeline.transformer.enable_cache(TaylorSeerCacheConfig(cache_interval=2, taylor_factors_dtype=dtype))
        try:
            with torch.inference_mode():
                out = pipeline(
                    prompt_embeds=rows,
                    image=images,
                    height=SIZE,
                    width=SIZE,
                    num_inference_steps=steps,
                    guidance_scale=1.0,
                    generator=torch.Generator("cpu").manual_seed(SEED),
                    output_type="np",
                ).images[0]
        finally:
            if hook:
                pipeline.transformer.disable_cache()
        return np.round(out * 255).astype("uint8")

    reference_picture = cached(torch.float32)
    assert levels(reference_picture, cached(torch.float32, hook=False)) > 3 * FP32_PIXELS  # the hook changes it
    check_pixels(edited, reference_picture, cached(torch.bfloat16) if pair.dtype == torch.bfloat16 else None)


@pytest.mark.parametrize(
    ("images", "masked", "extra", "param"),
    [
        ([picture(1)], False, {"strength": 0.5}, "strength"),
        ([picture(1)], False, {"input_fidelity": "high"}, "input_fidelity"),
        ([picture(n) for n in range(5)], False, {}, "image"),
        ([picture(1), picture(2, 63, 64)], False, {}, "image"),
        ([picture(1, 64, 576)], False, {}, "image"),
        ([picture(1)], True, {"size": "128x128", "strength": 0.5}, "size"),
    ],
    ids=["strength-without-mask", "fidelity-without-mask", "five-pictures", "a-side-under-64", "aspect-9", "mask-size"],
)
def test_what_the_pipelines_refuse_is_a_400_naming_the_field_and_the_next_edit_renders(
    pair, images, masked, extra, param
):
    extra = dict(extra)
    size = extra.pop("size", "auto")
    with pytest.raises(openai.BadRequestError) as refused:
        pair.edit(images, repaint_mask() if masked else None, size=size, **extra)
    assert isinstance(refused.value.body, dict) and refused.value.body["param"] == param
    assert pair.edit([picture(1)]).shape == (SIZE, SIZE, 3)


def test_a_mask_of_another_size_than_the_first_picture_is_a_400_naming_it(pair):
    other = Image.new("RGBA", (SIZE, SIZE + 16), (0, 0, 0, 0))
    answer = httpx.post(
        f"{pair.ar.url}/v1/images/edits",
        data={"prompt": PROMPT, "strength": "0.5"},
        files={"image": ("in.png", png(picture(1)), "image/png"), "mask": ("m.png", png(other), "image/png")},
        timeout=60,
    )
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "mask"


# --- the checkpoint can tell, and the checks do ----------------------------------------------------------


def test_the_checkpoint_tells_the_reference_picture_the_mask_and_a_strength_step(reference):
    edited = rendered(reference, [picture(1)])
    assert levels(edited, rendered(reference, [picture(3)])) > LEVELS
    masked = rendered(reference, [picture(1)], repaint_mask())
    assert levels(masked, rendered(reference, [picture(1), picture(2)], repaint_mask())) > LEVELS
    assert levels(masked, rendered(reference, [picture(1)], repaint_mask(), strength=STRENGTH + 0.1)) > LEVELS


def test_the_checks_catch_another_picture_a_shifted_or_inverted_mask_and_strength_off_by_a_tenth(reference):
    """Each case: what was asked, and the nearest plausible mistake; the checks pass diffusers' own bf16 picture of
    what was asked and fail the mistake, in fp32 and against that bf16 error."""
    one, two, mask = [picture(1)], [picture(1), picture(2)], repaint_mask()
    Asked = tuple[list[Image.Image], np.ndarray | None, float]
    cases: dict[str, tuple[Asked, Asked]] = {
        "another reference picture": ((one, None, STRENGTH), ([picture(3)], None, STRENGTH)),
        "another second reference": ((two, None, STRENGTH), ([picture(1), picture(3)], None, STRENGTH)),
        "another inpaint reference": ((two, mask, STRENGTH), ([picture(1), picture(3)], mask, STRENGTH)),
        "mask shifted a pixel": ((one, mask, STRENGTH), (one, repaint_mask(shift=1), STRENGTH)),
        "mask inverted": ((one, mask, STRENGTH), (one, repaint_mask(inverted=True), STRENGTH)),
        "strength + 0.1": ((one, mask, STRENGTH), (one, mask, STRENGTH + 0.1)),
        "strength - 0.1": ((one, mask, STRENGTH), (one, mask, STRENGTH - 0.1)),
    }
    for name, (asked, mistaken) in cases.items():
        right, wrong = rendered(reference, *asked), rendered(reference, *mistaken)
        images, asked_mask, strength = asked
        own = rendered(reference, images, asked_mask, strength, dtype=torch.bfloat16)
        assert levels(wrong, right) >= 3 * FP32_PIXELS, name
        check_pixels(own, right, own)
        with pytest.raises(AssertionError):
            check_pixels(wrong, right)
        with pytest.raises(AssertionError):
            check_pixels(wrong, right, own)


def test_the_ars_memory_stays_flat_over_200_refused_edits_and_the_next_edit_renders(pair):
    """The AR runs in this process: its RSS is the test's. A bomb's header, a picture under 64 px, a mask without
    alpha are refused from their headers; a truncated picture fails in its decode, its held memory released."""
    from tests.ar_service.test_input_images import png_header_only

    whole = png(picture(1, 96, 96))
    no_alpha = png(Image.new("RGB", (96, 96)))
    bad: list[dict[str, Any]] = [
        {"image": [("bomb.png", png_header_only(5000, 5000), "image/png")]},
        {"image": [("small.png", png(picture(1, 48, 96)), "image/png")]},
        {"image": [("in.png", whole, "image/png")], "mask": ("m.png", no_alpha, "image/png")},
        {"image": [("cut.png", whole[: len(whole) // 2], "image/png")]},
    ]

    def refuse(times: int) -> None:
        for n in range(times):
            with pytest.raises(openai.BadRequestError) as refused:
                pair.client.images.edit(prompt=PROMPT, **bad[n % len(bad)])
            assert isinstance(refused.value.body, dict) and refused.value.body["param"] in ("image", "mask")

    refuse(20)  # warm-up: the first requests allocate what every request reuses
    before = psutil.Process().memory_info().rss
    refuse(200)
    grew = (psutil.Process().memory_info().rss - before) / 2**20
    assert grew < 20, f"RSS grew {grew:.1f} MB over 200 refused edits"
    assert pair.edit([picture(1)]).shape == (SIZE, SIZE, 3)
