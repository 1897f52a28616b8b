"""The runner against plain diffusers: same bytes, previews on schedule, stops when told."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline
from PIL import Image
from prometheus_client import CollectorRegistry

from dit_service.conditioning import Conditioning
from dit_service.image_encoder import ImageEncoder
from dit_service.latent_decoder import LatentDecoder
from dit_service.metrics import DitMetrics
from dit_service.pipeline_runner import PipelineRunner, RenderCancelled, RenderJob
from shared.result_frames import ImageFrame, PartialImageFrame, ProgressFrame
from tests.dit_service.handoff_requests import hidden_rows, params

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runner(tiny_model) -> PipelineRunner:
    return PipelineRunner(tiny_model, LatentDecoder(tiny_model), ImageEncoder(), DitMetrics(CollectorRegistry()))


@pytest.fixture(scope="module")
def reference_pipeline(tiny_checkpoint) -> QwenImagePipeline:
    pipeline = QwenImagePipeline.from_pretrained(str(tiny_checkpoint), text_encoder=None, tokenizer=None)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def conditioning(rows: int = 9, seed: int = 0, negative: bool = False) -> Conditioning:
    embeds = hidden_rows(rows, seed=seed).unsqueeze(0)
    mask = torch.ones((1, rows), dtype=torch.long)
    if not negative:
        return Conditioning(embeds, mask)
    return Conditioning(embeds, mask, hidden_rows(5, seed=seed + 1).unsqueeze(0), torch.ones((1, 5), dtype=torch.long))


def render(runner, job) -> list:
    """The previews and images a render emits (progress frames are left out)."""
    frames = []
    runner.render(job, frames.append, threading.Event())
    return [f for f in frames if not isinstance(f, ProgressFrame)]


def test_progress_is_reported_after_every_step_of_every_image(runner):
    frames = []
    runner.render(
        RenderJob("r", conditioning(), params(num_images=2, num_inference_steps=3)), frames.append, threading.Event()
    )
    progress = [(f.step, f.steps) for f in frames if isinstance(f, ProgressFrame)]
    assert progress == [(step, 6) for step in range(1, 7)]


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.mark.parametrize("negative, guidance", [(False, 0.0), (True, 3.0)], ids=["plain", "cfg"])
def test_images_are_bitwise_those_of_plain_diffusers(runner, reference_pipeline, negative, guidance):
    cond = conditioning(negative=negative)
    job = RenderJob("r", cond, params(num_inference_steps=3, guidance_scale=guidance, seed=11))
    [frame] = render(runner, job)
    extra = {}
    if negative:
        extra = {
            "negative_prompt_embeds": cond.negative_prompt_embeds,
            "negative_prompt_embeds_mask": cond.negative_prompt_embeds_mask,
        }
    expected = reference_pipeline(
        prompt_embeds=cond.prompt_embeds,
        prompt_embeds_mask=cond.prompt_embeds_mask,
        true_cfg_scale=guidance if negative else 1.0,
        height=32,
        width=32,
        num_inference_steps=3,
        generator=torch.Generator("cpu").manual_seed(11),
        output_type="np",
        **extra,
    ).images[0]
    assert np.array_equal(pixels(frame.data), (expected * 255).round().astype("uint8"))


def test_cfg_changes_the_image(runner):
    [plain] = render(runner, RenderJob("r", conditioning(negative=True), params(guidance_scale=1.0)))
    [guided] = render(runner, RenderJob("r", conditioning(negative=True), params(guidance_scale=4.0)))
    assert plain.data != guided.data


def test_each_image_uses_its_own_consecutive_seed(runner):
    frames = render(runner, RenderJob("r", conditioning(), params(num_images=2, seed=5)))
    assert [(f.image_index, f.seed) for f in frames] == [(0, 5), (1, 6)]
    [alone] = render(runner, RenderJob("r", conditioning(), params(num_images=1, seed=6)))
    assert frames[1].data == alone.data
    assert frames[0].data != frames[1].data


def test_partial_images_come_on_schedule_before_their_final_image(runner):
    job = RenderJob("r", conditioning(), params(num_inference_steps=6, partial_images=2, num_images=2))
    frames = render(runner, job)
    assert [(type(f).__name__, f.image_index) for f in frames] == [
        ("PartialImageFrame", 0),
        ("PartialImageFrame", 0),
        ("ImageFrame", 0),
        ("PartialImageFrame", 1),
        ("PartialImageFrame", 1),
        ("ImageFrame", 1),
    ]
    partials = [f for f in frames if isinstance(f, PartialImageFrame)]
    assert [(f.partial_image_index, f.step) for f in partials[:2]] == [(0, 2), (1, 4)]
    assert all(pixels(f.data).shape == (32, 32, 3) for f in partials)


def test_previews_approach_the_final_image(runner):
    job = RenderJob("r", conditioning(), params(num_inference_steps=8, partial_images=3))
    frames = render(runner, job)
    final = pixels(frames[-1].data).astype(float)
    errors = [np.abs(pixels(f.data) - final).mean() for f in frames if isinstance(f, PartialImageFrame)]
    assert errors == sorted(errors, reverse=True)
    assert errors[-1] < errors[0]


def test_cancel_stops_at_the_next_denoising_step(runner, tiny_model):
    cancel = threading.Event()
    steps_run = []
    hook = tiny_model.transformer.register_forward_hook(lambda *_: steps_run.append(1))
    frames = []

    def emit(frame):
        if isinstance(frame, ProgressFrame):
            return
        frames.append(frame)
        cancel.set()  # the consumer goes away after the first preview

    job = RenderJob("r", conditioning(), params(num_inference_steps=20, partial_images=3))
    try:
        with pytest.raises(RenderCancelled):
            runner.render(job, emit, cancel)
    finally:
        hook.remove()
    # The first preview is taken after step index 4 (of 20); the run stops in the next callback.
    assert [type(f) for f in frames] == [PartialImageFrame]
    assert len(steps_run) == 6
    assert not any(isinstance(f, ImageFrame) for f in frames)


def test_every_denoising_step_is_timed_and_every_image_sized(tiny_model):
    metrics = DitMetrics(CollectorRegistry())
    runner = PipelineRunner(tiny_model, LatentDecoder(tiny_model), ImageEncoder(), metrics)
    job = RenderJob("r", conditioning(), params(num_inference_steps=3, num_images=2, partial_images=1, width=48))
    denoise_started = metrics.denoise_seconds._sum.get()
    render(runner, job)
    steps = metrics.denoise_step_seconds.collect()[0]
    [count] = [s.value for s in steps.samples if s.name.endswith("_count")]
    [step_sum] = [s.value for s in steps.samples if s.name.endswith("_sum")]
    assert count == 3 * 2
    # Steps add up to no more than the denoising loops, previews left out of both.
    assert 0 < step_sum <= metrics.denoise_seconds._sum.get() - denoise_started
    pixels_of = {s.labels.get("le"): s.value for s in metrics.image_pixels.collect()[0].samples}
    assert pixels_of["65536.0"] == 2  # two 48x32 images, in the smallest bucket
