"""Z-Image and FLUX.2 [klein] through the running services, against diffusers' own ``ZImagePipeline`` and
``Flux2KleinPipeline`` on the same weights: the tiny checkpoints ``make checkpoints`` builds in each family's
published layout (Qwen3 text encoder, Qwen's tokenizer and chat template, the family's transformer and VAE), both
services given that folder and nothing else of the model, in fp32 and in bf16 (the default on a CPU that multiplies
it natively, as this one does; judged against the fp32 reference relative to diffusers' own bf16-vs-fp32 error, as
tests/e2e/test_qwen_image_reference.py judges Qwen-Image).

What conditions the DiT equals the pipeline's ``encode_prompt``: the chat template's token ids, every row kept,
within 5e-5 (Z-Image: ``hidden_states[-2]`` before the final norm; FLUX.2: layers 9, 18 and 27 side by side, its
real rows: a causal engine cannot compute the 512-row padding's, benchmarks/results/flux2_pad_rows.md). The pictures
equal the pipeline's ``__call__`` with the same seed within 2/255 (FLUX.2: given those real rows; Z-Image with CFG
too, against its default negative prompt). A shared style prefix is a prefix-cache hit that renders bitwise what a
miss renders. Both edit; Z-Image streams previews. What a family cannot do (FLUX.2's previews, a step cache diffusers
does not run on it, guidance a distilled FLUX.2 ignores) is a 400 naming the parameter. ``make run``
serves each given the DiT's folder alone. ``test_the_checks_catch_*`` show that the row check fails on another layer,
the other side of the norm or the other chat template.
"""

from __future__ import annotations

import base64
import io
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from diffusers import Flux2KleinPipeline, ZImagePipeline
from openai import OpenAI
from PIL import Image

from dit_service.conditioning import Conditioning, ConditioningAdapter
from services.checkpoints import FLUX2_KLEIN_MODEL, Z_IMAGE_MODEL, default_model_dir
from services.model_card import ModelCard
from shared.handoff_assembler import AssembledHandoff
from tests.conftest import require_checkpoint
from tests.e2e.conftest import pair_on_folder
from tests.support.launched_pair import launched_pair
from tests.support.live_server import LiveServer
from tests.support.reference_checks import check_pixels, check_rows

pytestmark = pytest.mark.slow

SIZE, STEPS, SEED = "64x64", 4, 7
STYLE = "In the style of a detailed botanical illustration, " + ", ".join(f"fine line {i}" for i in range(40)) + ": "
# Sub-block, a sentence, past one 128-token CPU block, and not Latin.
PROMPTS = [
    "a red circle",
    "A watercolour of a lighthouse on a cliff at dusk, gulls over the surf, warm light in the lamp room",
    STYLE + "a fern",
    "一只在雪地里奔跑的红色狐狸 水彩画",
]
PAIRS = [(name, dtype) for name in ("z-image", "flux2-klein") for dtype in ("float32", "bfloat16")]


@dataclass(frozen=True)
class Family:
    folder: Path
    pipeline: Any  # the diffusers class
    # transformers' hidden_states whose rows condition it, side by side, and its chat template's argument.
    layers: tuple[int, ...]
    enable_thinking: bool

    def text(self, tokenizer: Any, prompt: str, enable_thinking: bool | None = None) -> str:
        thinking = self.enable_thinking if enable_thinking is None else enable_thinking
        messages = [{"role": "user", "content": prompt}]
        return str(
            tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
            )
        )


FAMILIES = {
    "z-image": Family(default_model_dir(Z_IMAGE_MODEL), ZImagePipeline, (-2,), enable_thinking=True),
    "flux2-klein": Family(default_model_dir(FLUX2_KLEIN_MODEL), Flux2KleinPipeline, (9, 18, 27), False),
}


class Recorder:
    """Records each conditioning the DiT builds (the requests here run one at a time)."""

    def __init__(self) -> None:
        self.seen: list[tuple[AssembledHandoff, Conditioning]] = []
        self.negative: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def wrap(self, select):
        def recorded(adapter: ConditioningAdapter, handoff: AssembledHandoff) -> Conditioning:
            conditioning = select(adapter, handoff)
            self.seen.append((handoff, conditioning))
            return conditioning

        return recorded

    def take(self) -> tuple[AssembledHandoff, torch.Tensor]:
        ((handoff, conditioning),) = self.seen
        self.seen.clear()
        self.negative = conditioning.negative_prompt_embeds, conditioning.negative_prompt_embeds_mask
        mask = conditioning.prompt_embeds_mask
        return handoff, conditioning.prompt_embeds[0, : int(mask.sum())]

    def negative_rows(self) -> torch.Tensor:
        """The last request's negative rows (with CFG)."""
        embeds, mask = self.negative
        assert embeds is not None and mask is not None
        return embeds[0, : int(mask.sum())]


@dataclass
class Pair:
    dtype: torch.dtype
    family: Family
    client: OpenAI
    recorder: Recorder
    ar: LiveServer

    def generate(self, prompt: str, **extra) -> tuple[np.ndarray, AssembledHandoff, torch.Tensor, dict]:
        result = self.client.images.generate(
            prompt=prompt, size=SIZE, extra_body={"seed": SEED, "num_inference_steps": STEPS, **extra}
        )
        assert result.data is not None
        image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json or "")))
        usage = (result.usage.model_extra if result.usage is not None else {}) or {}
        handoff, rows = self.recorder.take()
        return np.asarray(image.convert("RGB")), handoff, rows, usage


@pytest.fixture(scope="module", params=PAIRS, ids=[f"{name}-{dtype}" for name, dtype in PAIRS])
def pair(request) -> Iterator[Pair]:
    """Both services at their defaults on the family's folder, in each dtype (pair_on_folder), recording what
    conditions each render."""
    name, dtype_name = request.param
    family = FAMILIES[name]
    recorder = Recorder()
    with pair_on_folder(family.folder, dtype_name, recorder.wrap) as (client, ar):
        yield Pair(getattr(torch, dtype_name), family, client, recorder, ar)


@pytest.fixture(scope="module")
def pipelines() -> dict[tuple[str, torch.dtype], Any]:
    """Each family's own diffusers pipeline, with its text encoder, loaded once per dtype."""
    return {}


@pytest.fixture
def reference(pair, pipelines) -> dict[torch.dtype, Any]:
    """The pair's family's own pipeline in fp32 (the reference) and in bf16 (its own bf16 error)."""
    for dtype in (torch.float32, torch.bfloat16):
        if (str(pair.family.folder), dtype) not in pipelines:
            pipeline = pair.family.pipeline.from_pretrained(str(pair.family.folder), dtype=dtype)
            pipeline.set_progress_bar_config(disable=True)
            pipelines[str(pair.family.folder), dtype] = pipeline
    return {dtype: pipelines[str(pair.family.folder), dtype] for dtype in (torch.float32, torch.bfloat16)}


def encoded(family: Family, pipeline: Any, prompt: str) -> torch.Tensor:
    """The rows the pipeline's ``encode_prompt`` conditions on, its unpadded ones."""
    with torch.inference_mode():
        if family.pipeline is ZImagePipeline:
            (rows,), _ = pipeline.encode_prompt(prompt, device=torch.device("cpu"), do_classifier_free_guidance=False)
            return rows.float()
        embeds, _ = pipeline.encode_prompt(prompt=prompt, device=torch.device("cpu"))
    real = len(pipeline.tokenizer(family.text(pipeline.tokenizer, prompt))["input_ids"])
    return embeds[0, :real].float()


def rendered(family: Family, pipeline: Any, prompt: str, seed: int = SEED, guidance: float | None = None) -> np.ndarray:
    """The pipeline's own picture: Z-Image's from the prompt (CFG against its default negative prompt, "", where
    ``guidance`` is above 0); FLUX.2's from its ``encode_prompt``'s real rows."""
    width, height = map(int, SIZE.split("x"))
    common: dict[str, Any] = dict(
        height=height,
        width=width,
        num_inference_steps=STEPS,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
    )
    if family.pipeline is ZImagePipeline:
        image = pipeline(prompt=prompt, guidance_scale=guidance or 0.0, **common).images[0]
    else:
        rows = encoded(family, pipeline, prompt)[None].to(pipeline.dtype)
        image = pipeline(prompt_embeds=rows, guidance_scale=1.0, **common).images[0]
    return (image * 255).round().astype("uint8")


def test_the_dit_announces_its_familys_recipe_and_the_ar_reads_rows_by_it(pair):
    assert httpx.get(f"{pair.ar.url}/readyz").status_code == 200
    engine = pair.ar.app.state.runtime.engine
    dit = pair.ar.call(pair.ar.app.state.runtime.readiness.require())[0]
    assert dit.rows == engine.rows and dit.rows is not None
    assert dit.rows.final_norm is False and dit.rows.template is None and dit.rows.conditioning == "every_row"
    assert dit.row_width == engine.row_width == len(pair.family.layers) * engine.text_model.hidden_size


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "sentence", "past-a-block", "chinese"])
def test_what_conditions_the_dit_is_what_encode_prompt_gives(pair, reference, prompt):
    _, handoff, rows, _ = pair.generate(prompt, cache_salt=f"cold-{pair.dtype}-{PROMPTS.index(prompt)}")
    stream, fp32 = handoff.streams["cond"], reference[torch.float32]
    expected_ids = fp32.tokenizer(pair.family.text(fp32.tokenizer, prompt))["input_ids"]
    assert stream.prefix_tokens == 0  # every row of the chat template conditions it
    assert stream.token_ids[: stream.answer_start_index] == expected_ids
    check_rows(rows, encoded(pair.family, fp32, prompt), own_bf16(pair, reference, encoded, prompt))


def own_bf16(pair: Pair, reference: dict[torch.dtype, Any], what: Any, *args: Any, **kwargs: Any) -> Any:
    """``what`` diffusers' own bf16 pipeline gives, where the pair runs bf16 (its error is the bound); else None."""
    if pair.dtype != torch.bfloat16:
        return None
    return what(pair.family, reference[torch.bfloat16], *args, **kwargs)


def test_pictures_are_what_the_pipeline_renders_with_the_same_seed(pair, reference):
    image, _, _, _ = pair.generate(PROMPTS[1])
    fp32 = rendered(pair.family, reference[torch.float32], PROMPTS[1])
    check_pixels(image, fp32, own_bf16(pair, reference, rendered, PROMPTS[1]))


def test_each_of_n_images_is_what_the_pipeline_renders_with_its_own_seed(pair, reference):
    result = pair.client.images.generate(
        prompt=PROMPTS[0], size=SIZE, n=2, extra_body={"seed": SEED, "num_inference_steps": STEPS}
    )
    assert result.data is not None and len(result.data) == 2
    pair.recorder.seen.clear()
    for index, datum in enumerate(result.data):
        image = np.asarray(Image.open(io.BytesIO(base64.b64decode(datum.b64_json or ""))).convert("RGB"))
        fp32 = rendered(pair.family, reference[torch.float32], PROMPTS[0], seed=SEED + index)
        check_pixels(image, fp32, own_bf16(pair, reference, rendered, PROMPTS[0], seed=SEED + index))


def test_a_shared_style_prefix_is_a_cache_hit_that_renders_what_a_miss_renders(pair):
    first, second = STYLE + "a fern", STYLE + "a lighthouse"
    pair.generate(first, cache_salt=f"style-{pair.dtype}")
    hit_image, _, hit_rows, hit_usage = pair.generate(second, cache_salt=f"style-{pair.dtype}")
    miss_image, _, miss_rows, miss_usage = pair.generate(second, cache_salt=f"style-cold-{pair.dtype}")
    assert miss_usage["cached_tokens"] == 0 and hit_usage["cached_tokens"] >= 128
    if pair.dtype == torch.float32:
        assert torch.equal(hit_rows, miss_rows) and np.array_equal(hit_image, miss_image)
    else:  # bf16: the reused prefix rows are bitwise the cold ones (benchmarks/results/bf16_hit_miss.md: the rest)
        cached = hit_usage["cached_tokens"]
        assert torch.equal(hit_rows[:cached], miss_rows[:cached])


def test_guidance_is_what_the_familys_pipeline_does_with_it(pair, reference):
    """Z-Image's ``guidance_scale`` is ZImagePipeline's: CFG above 0, against its default negative prompt ("", its
    chat template's rows); a distilled FLUX.2 [klein] ignores guidance, so more than 1 is a 400, not ignored."""
    if pair.family.pipeline is Flux2KleinPipeline:
        with pytest.raises(openai.BadRequestError) as refused:
            pair.generate(PROMPTS[0], guidance_scale=1.5)
        assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "guidance_scale"
        assert pair.recorder.seen == []
        return
    image, handoff, _, _ = pair.generate(PROMPTS[1], guidance_scale=4.0)
    assert handoff.open.diffusion.cfg and "uncond" in handoff.streams
    fp32 = reference[torch.float32]
    check_rows(pair.recorder.negative_rows(), encoded(pair.family, fp32, ""), own_bf16(pair, reference, encoded, ""))
    guided = rendered(pair.family, fp32, PROMPTS[1], guidance=4.0)
    check_pixels(image, guided, own_bf16(pair, reference, rendered, PROMPTS[1], guidance=4.0))


def test_a_step_cache_the_family_does_not_run_is_a_400_naming_it_and_flux2s_taylorseer_renders(pair):
    with pytest.raises(openai.BadRequestError) as refused:
        pair.generate(PROMPTS[0], step_cache={"method": "first_block", "threshold": 0.2})
    assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "step_cache"
    assert pair.recorder.seen == []
    taylorseer = {"method": "taylorseer", "interval": 2}
    if pair.family.pipeline is Flux2KleinPipeline:
        image, _, _, _ = pair.generate(PROMPTS[0], step_cache=taylorseer)
        assert image.shape == (64, 64, 3)
    else:
        with pytest.raises(openai.BadRequestError):
            pair.generate(PROMPTS[0], step_cache=taylorseer)


def test_both_edit_and_z_image_streams_previews_flux2s_are_a_400(pair):
    streamed = httpx.post(
        f"{pair.ar.url}/v1/images/generations",
        json={"prompt": PROMPTS[0], "size": SIZE, "stream": True, "partial_images": 2, "num_inference_steps": STEPS},
        timeout=120,
    )
    if pair.family.pipeline is Flux2KleinPipeline:
        assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "partial_images"
        assert pair.recorder.seen == []
    else:
        events = [line.removeprefix("event: ") for line in streamed.text.splitlines() if line.startswith("event: ")]
        assert streamed.status_code == 200
        assert events == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
        pair.recorder.take()
    picture = io.BytesIO()
    Image.new("RGB", (64, 64), "red").save(picture, format="PNG")
    edited = httpx.post(
        f"{pair.ar.url}/v1/images/edits",
        data={"prompt": PROMPTS[0]},
        files={"image": ("red.png", picture.getvalue(), "image/png")},
        timeout=60,
    )
    # Both edit (tests/e2e/test_z_image_edits_reference.py, tests/e2e/test_flux2_klein_edits_reference.py).
    assert edited.status_code == 200
    pair.recorder.take()


# --- each check fails on what a defect would produce -----------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_checks_catch_another_layer_the_other_side_of_the_norm_or_the_other_chat_template(name):
    family = FAMILIES[name]
    pipeline = family.pipeline.from_pretrained(str(require_checkpoint(family.folder)), dtype=torch.float32)
    prompt = PROMPTS[1]
    right = encoded(family, pipeline, prompt)
    tokenizer, encoder = pipeline.tokenizer, pipeline.text_encoder
    layers = list(family.layers)

    def rows(text: str, picked: list[int], normed: bool = False) -> torch.Tensor:
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        with torch.inference_mode():
            states = encoder(input_ids=ids, output_hidden_states=True).hidden_states
        norm = encoder.norm if hasattr(encoder, "norm") else encoder.model.norm
        parts = [norm(states[k]) if normed else states[k] for k in picked]
        return torch.cat(parts, dim=-1)[0].float()

    text = family.text(tokenizer, prompt)
    check_rows(rows(text, layers), right)
    wrong = {
        "the layer before": rows(text, [k - 1 for k in layers]),
        "after the final norm": rows(text, layers, normed=True),
        "the other chat template": rows(family.text(tokenizer, prompt, not family.enable_thinking), layers),
    }
    bf16_pipeline = family.pipeline.from_pretrained(str(family.folder), dtype=torch.bfloat16)
    bf16 = encoded(family, bf16_pipeline, prompt)
    check_rows(bf16, right, diffusers_bf16=bf16)
    for candidate in wrong.values():
        with pytest.raises(AssertionError):
            check_rows(candidate, right)
        with pytest.raises(AssertionError):
            check_rows(candidate, right, diffusers_bf16=bf16)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_make_run_serves_the_family_given_the_dits_folder_alone(name, tmp_path):
    """``ARDIT_DIT_MODEL_DIR`` alone, as README says: the launcher gives the AR the same folder, the AR reads rows as
    its card says, the pair answers an image, and the launcher stops both services cleanly."""
    folder = require_checkpoint(FAMILIES[name].folder)
    with launched_pair(tmp_path / "launcher.log", folder) as launched:
        card = ModelCard.read(folder).rows
        announced = httpx.get(f"{launched.dit_url}/readyz", timeout=10).json()["capabilities"]
        assert card is not None and announced["rows"] == card.model_dump()
        services = [launched.service("ar_service"), launched.service("dit_service")]
        assert launched.generate(num_inference_steps=STEPS).status_code == 200
    assert launched.launcher.returncode == 0
    assert not any(service.is_running() for service in services)


def test_a_prompt_of_the_dits_most_rows_is_encoded_whole_and_one_row_more_is_a_400(pair, reference):
    """Every row of the chat template conditions these families, so the DiT's limit counts them all (512 at the
    defaults, as the pipelines' ``max_sequence_length``): exactly that many is encoded whole, one more is refused."""
    fp32 = reference[torch.float32]
    most = pair.ar.call(pair.ar.app.state.runtime.readiness.require())[0].limits.max_conditioning_rows

    def rows_of(words: int) -> int:
        return len(fp32.tokenizer(pair.family.text(fp32.tokenizer, "red " * words))["input_ids"])

    words = next(w for w in itertools.count(most - 16) if rows_of(w) == most)
    _, _, rows, _ = pair.generate("red " * words, cache_salt=f"most-{pair.dtype}")
    assert rows.shape[0] == most == 512
    with pytest.raises(openai.BadRequestError) as refused:
        pair.generate("red " * (words + 1))
    assert isinstance(refused.value.body, dict)
    assert (refused.value.body["param"], refused.value.body["code"]) == ("prompt", "context_length_exceeded")
    assert f"is {most + 1} tokens; the image model takes at most {most}" in refused.value.body["message"]
    assert pair.recorder.seen == []
