"""The renderer against plain diffusers: same bytes, previews on schedule, stops when told; several jobs
as one batch, each the image it is rendered alone."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch

# From their own modules: to a type checker diffusers' top-level names are its no-torch placeholder classes.
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_img2img import QwenImageImg2ImgPipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_inpaint import QwenImageInpaintPipeline
from PIL import Image
from prometheus_client import CollectorRegistry

from dit_service.conditioning import Conditioning
from dit_service.image_encoder import ImageEncoder
from dit_service.metrics import DitMetrics
from dit_service.render_job import EditInput, RenderCancelled, RenderItem, RenderJob, RenderOutcome
from dit_service.renderer import Renderer
from dit_service.vae_codec import VaeCodec
from shared.result_frames import ImageFrame, PartialImageFrame, ProgressFrame, ResultFrame
from tests.dit_service.handoff_requests import hidden_rows, params

pytestmark = pytest.mark.slow


def renderer_of(model, metrics: DitMetrics | None = None) -> Renderer:
    return Renderer(model, VaeCodec(model.vae), ImageEncoder(), metrics or DitMetrics(CollectorRegistry()))


@pytest.fixture(scope="module")
def runner(tiny_model) -> Renderer:
    return renderer_of(tiny_model)


def run(renderer: Renderer, job: RenderJob, emit, cancel: threading.Event | None = None) -> RenderOutcome:
    """One job through the renderer on its own; its outcome."""
    [outcome] = renderer.render([RenderItem(job, emit, cancel or threading.Event())])
    return outcome


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
    frames: list[ResultFrame] = []
    run(runner, job, frames.append)
    return [f for f in frames if not isinstance(f, ProgressFrame)]


def test_progress_is_reported_after_every_step_of_every_image(runner):
    frames: list[ResultFrame] = []
    run(runner, RenderJob("r", conditioning(), params(num_images=2, num_inference_steps=3)), frames.append)
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


def test_a_custom_schedule_is_bitwise_what_plain_diffusers_renders_with_it(runner, reference_pipeline):
    sigmas = [1.0, 0.8, 0.3]
    [frame] = render(runner, RenderJob("r", conditioning(), params(num_inference_steps=3, sigmas=sigmas, seed=4)))
    [default] = render(runner, RenderJob("r", conditioning(), params(num_inference_steps=3, seed=4)))
    cond = conditioning()
    expected = reference_pipeline(
        prompt_embeds=cond.prompt_embeds,
        prompt_embeds_mask=cond.prompt_embeds_mask,
        true_cfg_scale=1.0,
        height=32,
        width=32,
        num_inference_steps=3,
        sigmas=sigmas,
        generator=torch.Generator("cpu").manual_seed(4),
        output_type="np",
    ).images[0]
    assert np.array_equal(pixels(frame.data), (expected * 255).round().astype("uint8"))
    assert frame.data != default.data


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
        outcome = run(runner, job, emit, cancel)
    finally:
        hook.remove()
    assert isinstance(outcome, RenderCancelled)
    # The first preview is taken after step index 4 (of 20); the run stops in the next callback.
    assert [type(f) for f in frames] == [PartialImageFrame]
    assert len(steps_run) == 6
    assert not any(isinstance(f, ImageFrame) for f in frames)


def test_every_denoising_step_is_timed_and_every_image_sized(tiny_model):
    metrics = DitMetrics(CollectorRegistry())
    runner = renderer_of(tiny_model, metrics)
    job = RenderJob("r", conditioning(), params(num_inference_steps=3, num_images=2, partial_images=1, width=48))
    denoise_started = metrics.denoise_seconds._sum.get()
    render(runner, job)
    steps = next(iter(metrics.denoise_step_seconds.collect()))
    [count] = [s.value for s in steps.samples if s.name.endswith("_count")]
    [step_sum] = [s.value for s in steps.samples if s.name.endswith("_sum")]
    assert count == 3 * 2
    # Steps add up to no more than the denoising loops, previews left out of both.
    assert 0 < step_sum <= metrics.denoise_seconds._sum.get() - denoise_started
    pixels_of = {s.labels.get("le"): s.value for s in next(iter(metrics.image_pixels.collect())).samples}
    assert pixels_of["65536.0"] == 2  # two 48x32 images, in the smallest bucket


# --- edits ---------------------------------------------------------------------------------------

EDIT_SIZE = 32


def edit_image() -> Image.Image:
    pixels = np.zeros((EDIT_SIZE, EDIT_SIZE, 3), np.uint8)
    pixels[..., 0] = np.arange(EDIT_SIZE)[None, :] * 8
    pixels[..., 1] = np.arange(EDIT_SIZE)[:, None] * 8
    return Image.fromarray(pixels)


def edit_mask() -> Image.Image:
    mask = Image.new("L", (EDIT_SIZE, EDIT_SIZE), 0)
    mask.paste(255, (8, 8, 24, 24))
    return mask


def reference_latents(pipeline, pixels_in_range: torch.Tensor) -> torch.Tensor:
    """Plain diffusers: normalised latents (the distribution's mode) of [1, 3, H, W] pixels in [-1, 1]."""
    vae = pipeline.vae
    with torch.no_grad():
        mode = vae.encode(pixels_in_range.unsqueeze(2)).latent_dist.mode()
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape)
    std = torch.tensor(vae.config.latents_std).view(shape)
    return ((mode - mean) * (1.0 / std))[:, :, 0]


def edit_job(edit: EditInput, **overrides) -> RenderJob:
    return RenderJob("r", conditioning(), params(**{"num_inference_steps": 4, "seed": 13, **overrides}), edit)


@pytest.mark.parametrize("masked", [False, True], ids=["img2img", "inpaint"])
def test_edits_are_bitwise_those_of_plain_diffusers_edit_pipelines(runner, reference_pipeline, masked):
    mask = edit_mask() if masked else None
    [frame] = render(runner, edit_job(EditInput((edit_image(),), mask, 0.5)))
    components = {name: getattr(reference_pipeline, name) for name in ("vae", "transformer", "scheduler")}
    kind = QwenImageInpaintPipeline if masked else QwenImageImg2ImgPipeline
    # diffusers annotates text_encoder/tokenizer as required, but None is how a pipeline runs without them.
    pipeline = kind(**components, text_encoder=None, tokenizer=None)  # type: ignore[arg-type]
    pipeline.set_progress_bar_config(disable=True)
    image = pipeline.image_processor.preprocess(edit_image())
    extra = {}
    if masked:
        # What the inpaint pipeline encodes itself: the input with the region to repaint blanked.
        blanked = image * torch.from_numpy(np.asarray(mask) == 0)[None, None]
        extra = {"mask_image": mask, "masked_image_latents": reference_latents(pipeline, blanked)}
    cond = conditioning()
    expected = pipeline(
        image=reference_latents(pipeline, image),
        strength=0.5,
        prompt_embeds=cond.prompt_embeds,
        prompt_embeds_mask=cond.prompt_embeds_mask,
        true_cfg_scale=1.0,
        height=EDIT_SIZE,
        width=EDIT_SIZE,
        num_inference_steps=4,
        generator=torch.Generator("cpu").manual_seed(13),
        output_type="pil",
        **extra,
    ).images[0]
    if masked:
        expected = pipeline.image_processor.apply_overlay(mask, edit_image(), expected)
    assert np.array_equal(pixels(frame.data), np.asarray(expected))


def test_strength_zero_runs_no_step_and_returns_the_vae_round_trip(runner, reference_pipeline, tiny_model):
    steps_run = []
    hook = tiny_model.transformer.register_forward_hook(lambda *_: steps_run.append(1))
    try:
        [frame] = render(runner, edit_job(EditInput((edit_image(),), None, 0.0)))
    finally:
        hook.remove()
    assert steps_run == []
    vae, processor = reference_pipeline.vae, reference_pipeline.image_processor
    with torch.no_grad():
        x = processor.preprocess(edit_image()).unsqueeze(2)
        decoded = vae.decode(vae.encode(x).latent_dist.mode()).sample[:, :, 0]
    expected = np.asarray(processor.postprocess(decoded, output_type="pil")[0]).astype(int)
    # Measured: the service's normalise/denormalise round trip moves a pixel by at most one level.
    assert np.abs(pixels(frame.data).astype(int) - expected).max() <= 1


@pytest.mark.parametrize(("strength", "steps"), [(1.0, 4), (0.5, 2), (0.3, 2), (0.1, 1), (0.0, 0)])
def test_strength_is_the_part_of_the_schedule_that_runs(runner, strength, steps):
    """Of 4 steps, the last ceil(4 x strength) run (diffusers' img2img arithmetic)."""
    frames: list[ResultFrame] = []
    run(runner, edit_job(EditInput((edit_image(),), None, strength), num_images=2), frames.append)
    progress = [(f.step, f.steps) for f in frames if isinstance(f, ProgressFrame)]
    assert progress == [(step, 2 * steps) for step in range(1, 2 * steps + 1)]


def test_a_mask_keeps_every_other_pixel_in_previews_and_image(runner):
    job = edit_job(EditInput((edit_image(),), edit_mask(), 1.0), num_inference_steps=6, partial_images=2)
    frames = render(runner, job)
    assert [type(f).__name__ for f in frames] == ["PartialImageFrame", "PartialImageFrame", "ImageFrame"]
    outside = np.asarray(edit_mask()) == 0
    for frame in frames:
        assert np.array_equal(pixels(frame.data)[outside], np.asarray(edit_image())[outside])


def test_the_prompt_changes_the_masked_region(runner):
    edit = EditInput((edit_image(),), edit_mask(), 1.0)
    [first] = render(runner, RenderJob("r", conditioning(seed=0), params(num_inference_steps=4, seed=2), edit))
    [second] = render(runner, RenderJob("r", conditioning(seed=5), params(num_inference_steps=4, seed=2), edit))
    inside = np.asarray(edit_mask()) > 0
    assert not np.array_equal(pixels(first.data)[inside], pixels(second.data)[inside])


# --- batches -------------------------------------------------------------------------------------

# Measured here (tiny random model, 64x48, 4 steps, 3 jobs of 9/5/12 rows): batched images differ
# from solo ones by at most 1 level on a few pixels — float rounding of batched, masked attention
# (padding a job's rows to the batch's longest, like padding + mask in conditioning.py).
TOLERANCE = 1


def jobs(negative: bool = False, **overrides) -> list[RenderJob]:
    base = {"width": 64, "height": 48, "num_inference_steps": 4, **overrides}
    return [
        RenderJob(f"req_{i}", conditioning(rows, seed=i, negative=negative), params(seed=100 + i, **base))
        for i, rows in enumerate((9, 5, 12))
    ]


def run_batch(renderer: Renderer, batch: list[RenderJob], cancels: dict[str, threading.Event] | None = None):
    frames: dict[str, list] = {job.request_id: [] for job in batch}
    items = [
        RenderItem(job, frames[job.request_id].append, (cancels or {}).get(job.request_id, threading.Event()))
        for job in batch
    ]
    return renderer.render(items), frames


@pytest.mark.parametrize("negative", [False, True], ids=["plain", "cfg"])
def test_a_batched_image_is_the_image_rendered_alone(runner, negative):
    guidance = {"guidance_scale": 4.0} if negative else {}
    batch = jobs(negative=negative, partial_images=1, **guidance)
    results, frames = run_batch(runner, batch)
    assert not any(isinstance(r, RenderCancelled) for r in results)
    for job in batch:
        alone: list = []
        run(runner, job, alone.append)
        [image] = [f for f in frames[job.request_id] if isinstance(f, ImageFrame)]
        [expected] = [f for f in alone if isinstance(f, ImageFrame)]
        assert image.seed == expected.seed and (image.width, image.height) == (64, 48)
        assert np.abs(pixels(image.data).astype(int) - pixels(expected.data).astype(int)).max() <= TOLERANCE
        kinds = [type(f) for f in frames[job.request_id] if not isinstance(f, ProgressFrame)]
        assert kinds == [PartialImageFrame, ImageFrame]
        assert [f.step for f in frames[job.request_id] if isinstance(f, ProgressFrame)] == [1, 2, 3, 4]


def test_one_job_leaving_does_not_disturb_the_others(runner):
    batch = jobs()
    _, reference = run_batch(runner, batch)
    gone = threading.Event()
    gone.set()
    results, frames = run_batch(runner, batch, {"req_1": gone})
    assert isinstance(results[1], RenderCancelled) and not frames["req_1"]
    # The others go on as a batch of two, which rounds as a batch of another size does (TOLERANCE); at
    # 0f96938 this compared bytes, and failed on this machine's oneDNN at 1 level.
    for request_id in ("req_0", "req_2"):
        got, expected = pixels(frames[request_id][-1].data), pixels(reference[request_id][-1].data)
        assert np.abs(got.astype(int) - expected.astype(int)).max() <= TOLERANCE


def test_only_jobs_that_share_the_loop_share_a_batch(runner):
    one, other = jobs()[:2]
    assert one.batch_key == other.batch_key
    longer = RenderJob("x", one.conditioning, params(width=64, height=48, num_inference_steps=5))
    assert longer.batch_key != one.batch_key
    assert RenderJob("x", one.conditioning, params(num_images=2)).batch_key is None
    with pytest.raises(ValueError, match="cannot share a batch"):
        runner.render([RenderItem(job, lambda frame: None, threading.Event()) for job in (one, longer)])
