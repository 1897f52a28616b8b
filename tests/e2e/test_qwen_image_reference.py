"""A real Qwen-Image through the running services, against diffusers' own ``QwenImagePipeline`` on the same
weights: the tiny full checkpoint ``make checkpoints`` builds in Qwen-Image's published layout (Qwen2.5-VL
text encoder, Qwen's tokenizer, DiT), both services given that folder and nothing else of the model.

In fp32, what conditions the DiT equals ``encode_prompt`` (token ids after the template's 34, rows within
5e-5) and the pictures equal ``__call__`` with the same seed, with the model's CFG (its card's
``true_cfg_scale`` 4 against " ") and without it; a prefix-cache hit renders bitwise what a miss renders. In
bf16 (the default on a CPU that multiplies it natively, as this one does) the same is judged against the
fp32 reference, relative to diffusers' own bf16-vs-fp32 error. ``test_the_checks_catch_*`` show that each
comparison fails on what a wrong norm, layer, template drop or CFG mapping would produce.
"""

from __future__ import annotations

import base64
import io
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import openai
import pytest
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
from openai import OpenAI
from PIL import Image

from dit_service.conditioning import Conditioning, ConditioningAdapter
from services.checkpoints import FULL_QWEN_IMAGE_MODEL, default_model_dir
from services.model_card import QWEN_IMAGE
from shared.handoff_assembler import AssembledHandoff
from shared.handoff_encoder import HandoffEncoder
from tests.conftest import require_checkpoint
from tests.e2e.conftest import pair_on_folder
from tests.support.live_server import LiveServer
from tests.support.reference_checks import check_pixels, check_rows

pytestmark = pytest.mark.slow

FOLDER = default_model_dir(FULL_QWEN_IMAGE_MODEL)
CARD = QWEN_IMAGE
SIZE, STEPS, SEED = "64x64", 8, 7
# Sub-block, a sentence, past one 128-token CPU block with the template, and not Latin.
PROMPTS = [
    "a red circle",
    "A watercolour of a lighthouse on a cliff at dusk, gulls over the surf, warm light in the lamp room",
    "A detailed botanical illustration of " + ", ".join(f"leaf {i} with fine veins" for i in range(24)),
    "一只在雪地里奔跑的红色狐狸 水彩画",
]


@dataclass(frozen=True)
class Seen:
    """What the DiT's conditioning adapter was handed, and what it gave the pipeline."""

    handoff: AssembledHandoff
    conditioning: Conditioning

    def rows(self, stream: str = "cond") -> torch.Tensor:
        embeds, mask = (
            (self.conditioning.prompt_embeds, self.conditioning.prompt_embeds_mask)
            if stream == "cond"
            else (self.conditioning.negative_prompt_embeds, self.conditioning.negative_prompt_embeds_mask)
        )
        assert embeds is not None and mask is not None
        return embeds[0, : int(mask.sum())]


class Recorder:
    """Records each conditioning the DiT builds (the requests here run one at a time)."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []

    def wrap(self, select):
        def recorded(adapter: ConditioningAdapter, handoff: AssembledHandoff) -> Conditioning:
            conditioning = select(adapter, handoff)
            self.seen.append(Seen(handoff, conditioning))
            return conditioning

        return recorded

    def take(self) -> Seen:
        (seen,) = self.seen
        self.seen.clear()
        return seen


@dataclass
class Pair:
    dtype: torch.dtype
    client: OpenAI
    recorder: Recorder
    ar: LiveServer

    def generate(self, prompt: str, **extra) -> tuple[np.ndarray, Seen, dict]:
        result = self.client.images.generate(
            prompt=prompt, size=SIZE, extra_body={"seed": SEED, "num_inference_steps": STEPS, **extra}
        )
        assert result.data is not None
        image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json or "")))
        usage = result.usage.model_extra if result.usage is not None else {}
        return np.asarray(image.convert("RGB")), self.recorder.take(), usage or {}


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def pair(request) -> Iterator[Pair]:
    """Both services at their defaults on the folder, in each dtype (pair_on_folder), recording what conditions
    each render."""
    recorder = Recorder()
    with pair_on_folder(FOLDER, request.param, recorder.wrap) as (client, ar):
        yield Pair(getattr(torch, request.param), client, recorder, ar)


@pytest.fixture(scope="module")
def reference() -> dict[torch.dtype, QwenImagePipeline]:
    """diffusers' own pipeline on the folder, in fp32 (the reference) and in bf16 (its own bf16 error)."""
    pipelines = {}
    for dtype in (torch.float32, torch.bfloat16):
        pipeline = QwenImagePipeline.from_pretrained(str(require_checkpoint(FOLDER)), dtype=dtype)
        pipeline.set_progress_bar_config(disable=True)
        pipelines[dtype] = pipeline
    return pipelines


def encoded(pipeline: QwenImagePipeline, prompt: str) -> torch.Tensor:
    embeds, mask = pipeline.encode_prompt(prompt, device=torch.device("cpu"))  # no mask: every row is valid
    return (embeds[0] if mask is None else embeds[0, : int(mask.sum())]).float()


def rendered(pipeline: QwenImagePipeline, prompt: str, guidance: float) -> np.ndarray:
    cfg = {"negative_prompt": CARD.default_negative_prompt, "true_cfg_scale": guidance} if guidance > 1 else {}
    width, height = map(int, SIZE.split("x"))
    image = pipeline(
        prompt=prompt,
        height=height,
        width=width,
        num_inference_steps=STEPS,
        generator=torch.Generator("cpu").manual_seed(SEED),
        output_type="np",
        **cfg,
    ).images[0]
    return (image * 255).round().astype("uint8")


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "sentence", "past-a-block", "chinese"])
def test_what_conditions_the_dit_is_what_encode_prompt_gives(pair, reference, prompt):
    _, seen, _ = pair.generate(prompt, guidance_scale=1.0, cache_salt=f"cold-{pair.dtype}-{PROMPTS.index(prompt)}")
    stream, fp32 = seen.handoff.streams["cond"], reference[torch.float32]
    drop = fp32.prompt_template_encode_start_idx
    expected_ids = fp32.tokenizer(fp32.prompt_template_encode.format(prompt))["input_ids"]
    assert stream.prefix_tokens == drop == 34
    assert stream.token_ids[drop : stream.answer_start_index] == expected_ids[drop:]
    bf16 = encoded(reference[torch.bfloat16], prompt) if pair.dtype == torch.bfloat16 else None
    check_rows(seen.rows(), encoded(fp32, prompt), bf16)


def test_the_models_cfg_is_the_default_and_its_negative_rows_are_encode_prompts(pair, reference):
    _, seen, _ = pair.generate(PROMPTS[1])
    assert seen.handoff.open.diffusion.guidance_scale == CARD.default_guidance_scale == 4.0
    negative = CARD.default_negative_prompt or ""
    bf16 = encoded(reference[torch.bfloat16], negative) if pair.dtype == torch.bfloat16 else None
    check_rows(seen.rows("uncond"), encoded(reference[torch.float32], negative), bf16)


@pytest.mark.parametrize("guidance", [1.0, None], ids=["no-cfg", "the-models-cfg"])
def test_pictures_are_what_the_pipeline_renders_with_the_same_seed(pair, reference, guidance):
    asked = {} if guidance is None else {"guidance_scale": guidance}
    image, _, _ = pair.generate(PROMPTS[1], **asked)
    scale = (CARD.default_guidance_scale or 1.0) if guidance is None else guidance
    bf16 = rendered(reference[torch.bfloat16], PROMPTS[1], scale) if pair.dtype == torch.bfloat16 else None
    check_pixels(image, rendered(reference[torch.float32], PROMPTS[1], scale), bf16)


def test_a_prefix_cache_hit_renders_what_a_miss_renders(pair):
    prompt, salt = PROMPTS[2], f"hit-{pair.dtype}"
    miss_image, miss, miss_usage = pair.generate(prompt, cache_salt=salt)
    hit_image, hit, hit_usage = pair.generate(prompt, cache_salt=salt)
    assert miss_usage["cached_tokens"] == 0 and hit_usage["cached_tokens"] >= 128
    if pair.dtype == torch.float32:
        assert torch.equal(hit.rows(), miss.rows()) and np.array_equal(hit_image, miss_image)
    else:  # bf16: the reused prefix rows are bitwise the cold ones; benchmarks/results/bf16_hit_miss.md for the rest
        cached = hit_usage["cached_tokens"] - hit.handoff.streams["cond"].prefix_tokens
        assert torch.equal(hit.rows()[:cached], miss.rows()[:cached])


@pytest.mark.parametrize("pair", ["bfloat16"], indirect=True)
def test_bf16_rows_reach_the_dit_bitwise_as_the_engine_captured_them(pair, monkeypatch):
    sent: list[torch.Tensor] = []
    row_frames = HandoffEncoder.row_frames

    def recorded(encoder, stream, start, token_ids, rows):
        if stream == "cond":
            sent.append(rows.clone())
        return row_frames(encoder, stream, start, token_ids, rows)

    monkeypatch.setattr(HandoffEncoder, "row_frames", recorded)
    _, seen, _ = pair.generate(PROMPTS[2], guidance_scale=1.0, cache_salt="bitwise")
    stream = seen.handoff.streams["cond"]
    assert seen.handoff.open.dtype == "bfloat16" and stream.rows.dtype == torch.bfloat16
    width = pair.ar.app.state.runtime.engine.text_model.hidden_size
    assert stream.rows.shape[1] == width and stream.rows.nbytes == stream.rows.shape[0] * width * 2
    assert torch.equal(torch.cat(sent), stream.rows)
    assert torch.equal(seen.rows(), stream.rows[stream.prefix_tokens : stream.answer_start_index])


@pytest.mark.parametrize("pair", ["float32"], indirect=True)
def test_a_prompt_of_the_dits_most_rows_is_encoded_whole_and_one_row_more_is_a_400(pair, reference):
    pipeline = reference[torch.float32]
    most = pair.ar.call(pair.ar.app.state.runtime.readiness.require())[0].limits.max_conditioning_rows
    drop = pipeline.prompt_template_encode_start_idx

    def rows_of(words: int) -> int:
        return len(pipeline.tokenizer(pipeline.prompt_template_encode.format("red " * words))["input_ids"]) - drop

    words = next(w for w in itertools.count(most - 16) if rows_of(w) == most)
    _, seen, _ = pair.generate("red " * words, guidance_scale=1.0)
    check_rows(seen.rows(), encoded(pipeline, "red " * words))
    assert seen.rows().shape[0] == most == 512
    with pytest.raises(openai.BadRequestError) as refused:
        pair.generate("red " * (words + 1), guidance_scale=1.0)
    assert isinstance(refused.value.body, dict)
    assert (refused.value.body["param"], refused.value.body["code"]) == ("prompt", "context_length_exceeded")
    assert f"is {most + 1} tokens; the image model takes at most {most}" in refused.value.body["message"]


# --- each check fails on what a defect would produce -----------------------------------------------------


def test_the_checks_catch_rows_without_the_final_norm_from_another_layer_or_dropped_wrongly(reference):
    pipeline = reference[torch.float32]
    norm = pipeline.text_encoder.model.language_model.norm
    before_norm: list[torch.Tensor] = []
    hook = norm.register_forward_hook(lambda _module, inputs, _output: before_norm.append(inputs[0]))
    tokens = pipeline.tokenizer(pipeline.prompt_template_encode.format(PROMPTS[1]), return_tensors="pt")
    try:
        with torch.no_grad():
            states = pipeline.text_encoder(**tokens, output_hidden_states=True).hidden_states
            drop = pipeline.prompt_template_encode_start_idx
            right = states[-1][0, drop:]
            wrong = {
                "no final norm": before_norm[-1][0, drop:],
                "the layer before": norm(states[-3])[0, drop:],
                "one row too few dropped": states[-1][0, drop - 1 :],
                "one row too many dropped": states[-1][0, drop + 1 :],
            }
    finally:
        hook.remove()
    assert torch.equal(right, encoded(pipeline, PROMPTS[1]))
    bf16 = encoded(reference[torch.bfloat16], PROMPTS[1])
    for rows in wrong.values():
        with pytest.raises(AssertionError):
            check_rows(rows, right)
        with pytest.raises(AssertionError):
            check_rows(rows, right, diffusers_bf16=bf16)


def test_the_checks_catch_a_wrong_cfg_mapping(reference):
    """The fp32 check tells guidance 4 from 3 and 5 (and from none). bf16's own rounding moves pixels about as
    far as a guidance step of 1 does (mean 1.2/255 either way here), so there it only tells CFG from none: the
    mapping, the same code in both dtypes, is pinned by the fp32 check."""
    fp32, bf16 = reference[torch.float32], reference[torch.bfloat16]
    right = rendered(fp32, PROMPTS[1], 4.0)
    for scale in (1.0, 3.0, 5.0):
        with pytest.raises(AssertionError):
            check_pixels(rendered(fp32, PROMPTS[1], scale), right)
    with pytest.raises(AssertionError):
        check_pixels(rendered(fp32, PROMPTS[1], 1.0), right, diffusers_bf16=rendered(bf16, PROMPTS[1], 4.0))
