"""Z-Image and FLUX.2 [klein] through the DiT: each family's own diffusers pipeline, given the rows its
``encode_prompt`` reads, draws the picture; progress and stopping work as for Qwen-Image; what a family cannot
run is announced, or refused."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

# From their own modules: to a type checker diffusers' top-level names are its no-torch placeholder classes.
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
from diffusers.pipelines.z_image.pipeline_z_image import ZImagePipeline
from PIL import Image
from prometheus_client import CollectorRegistry

from dit_service.capabilities import dit_capabilities
from dit_service.conditioning import Conditioning
from dit_service.family_classes import LATENT_DECODERS
from dit_service.image_encoder import ImageEncoder
from dit_service.metrics import DitMetrics
from dit_service.model import DitModel
from dit_service.model_state import warmup_job
from dit_service.previews import clean_latent_estimate
from dit_service.render_job import RenderCancelled, RenderItem, RenderJob, RenderOutcome
from dit_service.renderer import Renderer
from dit_service.settings import DitSettings
from dit_service.step_cache import hook_config
from dit_service.z_image_latents import ZImageLatents
from services.checkpoints import FLUX2_KLEIN_MODEL, Z_IMAGE_MODEL, default_model_dir
from shared.diffusion import DiffusionParams, FirstBlockCache, TaylorSeerCache
from shared.errors import InvalidDiffusionParams
from shared.result_frames import ImageFrame, PartialImageFrame, ProgressFrame, ResultFrame
from tests.conftest import require_checkpoint

pytestmark = pytest.mark.slow

PROMPT = "a red cube on a blue floor"
SIZE = 64
# The conditioning adapters pad rows to a bucket (``pad_to_multiple``): the pads must never reach the transformer.
BUCKET = 8


@dataclass(frozen=True)
class FamilyUnderTest:
    """One family under test: its checkpoint, its pipeline, the rows its ``encode_prompt`` gives a prompt, and what
    its own ``__call__`` takes for them."""

    model: str
    pipeline: type[Any]
    rows: Callable[[Any, str], torch.Tensor]  # (reference pipeline, prompt) → [L, D], the prompt's real rows
    prompt_embeds: Callable[[torch.Tensor], Any]  # [L, D] → the pipeline's ``prompt_embeds``
    guidance_scale: float  # the card's

    @property
    def path(self) -> Path:
        return require_checkpoint(default_model_dir(self.model))


def z_image_rows(pipeline: Any, prompt: str) -> torch.Tensor:
    rows, _ = pipeline.encode_prompt(prompt, device="cpu", do_classifier_free_guidance=False)
    return rows[0]


def flux2_klein_rows(pipeline: Any, prompt: str) -> torch.Tensor:
    """The real rows of the 512 ``encode_prompt`` computes: those its tokenizer's mask keeps."""
    embeds, _ = pipeline.encode_prompt(prompt=prompt, device="cpu", num_images_per_prompt=1, max_sequence_length=512)
    messages = [{"role": "user", "content": prompt}]
    text = pipeline.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    mask = pipeline.tokenizer(text, padding="max_length", max_length=512, return_tensors="pt").attention_mask
    rows: torch.Tensor = embeds[0, mask[0].bool()]
    return rows


Z_IMAGE = FamilyUnderTest(Z_IMAGE_MODEL, ZImagePipeline, z_image_rows, lambda rows: [rows], 0.0)
FLUX2_KLEIN = FamilyUnderTest(FLUX2_KLEIN_MODEL, Flux2KleinPipeline, flux2_klein_rows, lambda rows: rows[None], 1.0)
FAMILIES = pytest.mark.parametrize("family", [Z_IMAGE, FLUX2_KLEIN], ids=["z_image", "flux2_klein"])


@pytest.fixture(scope="module")
def models() -> dict[str, DitModel]:
    return {f.model: DitModel.load(f.path, "cpu", "float32") for f in (Z_IMAGE, FLUX2_KLEIN)}


def renderer(models: dict[str, DitModel], family: FamilyUnderTest) -> Renderer:
    # These families' pipelines decode their own pictures; Z-Image's previews are decoded here.
    model = models[family.model]
    layout = model.card.latents
    vae = LATENT_DECODERS[layout](model.vae) if layout is not None else None
    return Renderer(model, vae, ImageEncoder(), DitMetrics(CollectorRegistry()))


def reference_pipeline(family: FamilyUnderTest) -> Any:
    """diffusers' own pipeline with its text encoder, as its users load it."""
    pipeline = family.pipeline.from_pretrained(str(family.path), dtype=torch.float32)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def diffusers_picture(reference: Any, prompt_embeds: Any, guidance: float, steps: int, **extra: Any) -> np.ndarray:
    """diffusers' own ``__call__`` given the rows, at seed 7."""
    image = reference(
        prompt_embeds=prompt_embeds,
        height=SIZE,
        width=SIZE,
        num_inference_steps=steps,
        guidance_scale=guidance,
        generator=torch.Generator("cpu").manual_seed(7),
        **extra,
    ).images[0]
    return np.asarray(image).astype(int)


def conditioning(rows: torch.Tensor) -> Conditioning:
    """``rows`` as the conditioning adapters hand them over: right-padded with zeros to the bucket, with a mask."""
    count = rows.shape[0]
    length = -(-count // BUCKET) * BUCKET + BUCKET  # at least one whole bucket of pads
    embeds = rows.new_zeros((1, length, rows.shape[1]))
    embeds[0, :count] = rows
    mask = torch.zeros((1, length), dtype=torch.long)
    mask[0, :count] = 1
    return Conditioning(embeds, mask)


def some_rows(model: DitModel, count: int = 11) -> torch.Tensor:
    return torch.randn(count, model.facts.row_width, generator=torch.Generator().manual_seed(3))


def params(family: FamilyUnderTest, **overrides: Any) -> DiffusionParams:
    values = {"width": SIZE, "height": SIZE, "num_inference_steps": 3, "guidance_scale": family.guidance_scale}
    return DiffusionParams(**{"seed": 0, **values, **overrides})


def run(renderer: Renderer, job: RenderJob, emit: Callable[[Any], None], cancel: threading.Event) -> RenderOutcome:
    [outcome] = renderer.render([RenderItem(job, emit, cancel)])
    return outcome


def frames_of(renderer: Renderer, job: RenderJob) -> list[ResultFrame]:
    frames: list[ResultFrame] = []
    run(renderer, job, frames.append, threading.Event())
    return frames


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(int)


@FAMILIES
def test_a_picture_equals_diffusers_own_pipeline_given_the_same_rows(models, family):
    """The rows diffusers' ``encode_prompt`` reads (FLUX.2: only the prompt's real rows, not its 512 padded ones),
    padded as the adapters pad them: the service's picture is diffusers' own ``__call__`` with those rows, to the
    byte. Bitwise, not within a tolerance: measured, the bucket's pad rows reaching FLUX.2's tiny transformer move
    a pixel by at most 2 levels, so a tolerance of 2 could not tell them apart."""
    reference = reference_pipeline(family)
    with torch.no_grad():
        rows = family.rows(reference, PROMPT)
    frames = frames_of(renderer(models, family), RenderJob("r", conditioning(rows), params(family, seed=7)))
    [frame] = [f for f in frames if isinstance(f, ImageFrame)]
    expected = diffusers_picture(reference, family.prompt_embeds(rows), family.guidance_scale, steps=3)
    assert np.array_equal(pixels(frame.data), expected)


@FAMILIES
def test_progress_is_reported_after_every_step_of_every_image(models, family):
    job = RenderJob("r", conditioning(some_rows(models[family.model])), params(family, num_images=2))
    frames = frames_of(renderer(models, family), job)
    assert [(f.step, f.steps) for f in frames if isinstance(f, ProgressFrame)] == [(s, 6) for s in range(1, 7)]
    assert [f.image_index for f in frames if isinstance(f, ImageFrame)] == [0, 1]


@FAMILIES
def test_a_consumer_that_leaves_stops_the_run_at_the_next_step(models, family):
    model, cancel, steps_run = models[family.model], threading.Event(), []
    hook = model.transformer.register_forward_hook(lambda *_: steps_run.append(1))
    frames: list[ResultFrame] = []

    def emit(frame: ResultFrame) -> None:
        frames.append(frame)
        cancel.set()  # the consumer goes away after the first step's progress

    try:
        outcome = run(
            renderer(models, family),
            RenderJob("r", conditioning(some_rows(model)), params(family, num_inference_steps=20)),
            emit,
            cancel,
        )
    finally:
        hook.remove()
    assert isinstance(outcome, RenderCancelled)
    # The first step ran and reported; the second ran before its callback saw the consumer gone.
    assert len(steps_run) == 2
    assert [type(f) for f in frames] == [ProgressFrame]


def test_a_z_image_picture_with_guidance_equals_diffusers_cfg_against_the_same_negative_rows(models):
    """ZImagePipeline runs CFG at any guidance above 0: the service hands it the negative rows as its
    ``negative_prompt_embeds`` (its default negative prompt is "", which the AR encodes for it)."""
    family = Z_IMAGE
    reference = reference_pipeline(family)
    with torch.no_grad():
        rows, negative = family.rows(reference, PROMPT), family.rows(reference, "")
    cond = conditioning(rows)
    uncond = conditioning(negative)
    both = Conditioning(cond.prompt_embeds, cond.prompt_embeds_mask, uncond.prompt_embeds, uncond.prompt_embeds_mask)
    job_params = params(family, seed=7, guidance_scale=4.0, cfg_above=0.0)
    assert job_params.cfg
    [frame] = [
        f for f in frames_of(renderer(models, family), RenderJob("r", both, job_params)) if isinstance(f, ImageFrame)
    ]
    expected = diffusers_picture(reference, [rows], 4.0, steps=3, negative_prompt_embeds=[negative])
    assert np.array_equal(pixels(frame.data), expected)
    unguided = frames_of(renderer(models, family), RenderJob("r", conditioning(rows), params(family, seed=7)))
    assert not np.array_equal(pixels(frame.data), pixels(next(f for f in unguided if isinstance(f, ImageFrame)).data))


def test_flux2_kleins_taylorseer_cache_is_diffusers_own_hook_on_the_same_run(models):
    """FLUX.2's transformer runs diffusers' TaylorSeer hook (``CacheMixin``): the service's picture is diffusers'
    pipeline with the same hook, to the byte, and steps were extrapolated rather than computed."""
    family, cache = FLUX2_KLEIN, TaylorSeerCache(method="taylorseer", interval=3)
    reference = reference_pipeline(family)
    with torch.no_grad():
        rows = family.rows(reference, PROMPT)
    service = renderer(models, family)
    job = RenderJob("r", conditioning(rows), params(family, seed=7, num_inference_steps=8, step_cache=cache))
    [frame] = [f for f in frames_of(service, job) if isinstance(f, ImageFrame)]
    reused = service.metrics.step_cache_passes.labels("taylorseer", "reused")._value.get()
    reference.transformer.enable_cache(hook_config(cache, torch.float32))
    try:
        expected = diffusers_picture(reference, family.prompt_embeds(rows), family.guidance_scale, steps=8)
    finally:
        reference.transformer.disable_cache()
    assert np.array_equal(pixels(frame.data), expected)
    assert reused > 0


@pytest.mark.parametrize(
    ("family", "layers", "row_width", "max_guidance_scale", "cfg_above", "step_caches", "previews", "edits"),
    [
        (Z_IMAGE, [3], 128, 50.0, 0.0, [], 3, True),
        (FLUX2_KLEIN, [9, 18, 27], 384, 1.0, 1.0, ["taylorseer"], 0, True),
    ],
    ids=["z_image", "flux2_klein"],
)
def test_each_family_announces_its_rows_and_refuses_what_it_does_not_run(
    models, family, layers, row_width, max_guidance_scale, cfg_above, step_caches, previews, edits
):
    model = models[family.model]
    caps = dit_capabilities(DitSettings(model_dir=family.path), model)
    assert caps.rows is not None and caps.rows == model.card.rows
    assert (caps.rows.layers, caps.rows.final_norm, caps.rows.conditioning) == (layers, False, "every_row")
    assert caps.row_width == row_width
    assert (caps.limits.step_caches, caps.defaults.step_cache) == (step_caches, None)
    assert (caps.limits.max_guidance_scale, caps.cfg_above) == (max_guidance_scale, cfg_above)
    assert caps.defaults.guidance_scale == family.guidance_scale  # the card's
    assert (caps.limits.max_partial_images, caps.limits.edits) == (previews, edits)
    refused = {
        "guidance_scale": params(family, guidance_scale=max_guidance_scale + 0.5),
        "step_cache": params(family, step_cache=FirstBlockCache(method="first_block", threshold=0.1)),
    }
    if previews == 0:
        refused["partial_images"] = params(family, partial_images=1)
    for param, asked in refused.items():
        with pytest.raises(InvalidDiffusionParams) as refusal:
            caps.limits.check(asked)
        assert refusal.value.param == param


def test_flux2_klein_jobs_never_share_a_run():
    """FLUX.2's transformer takes no mask over the rows, so rows of different lengths cannot share a batch."""
    model = DitModel.load(FLUX2_KLEIN.path, "cpu", "float32")
    runner = Renderer(model, None, ImageEncoder(), DitMetrics(CollectorRegistry()))
    jobs = [RenderJob(name, conditioning(some_rows(model)), params(FLUX2_KLEIN)) for name in "ab"]
    assert not runner.batches
    with pytest.raises(ValueError, match="cannot share a batch"):
        runner.render([RenderItem(job, lambda frame: None, threading.Event()) for job in jobs])


def test_a_batched_z_image_picture_is_the_picture_rendered_alone(models):
    """ZImagePipeline takes each image's rows as a list, of any lengths, and masks them itself: jobs of 11 and 23
    rows share a run, and each picture equals the job rendered alone but for float rounding (1 level, as
    Qwen-Image's batches, tests/dit_service/test_renderer.py)."""
    runner, model = renderer(models, Z_IMAGE), models[Z_IMAGE.model]
    jobs = [
        RenderJob(name, conditioning(some_rows(model, count)), params(Z_IMAGE, seed=seed))
        for name, count, seed in (("a", 11, 1), ("b", 23, 2))
    ]
    assert runner.batches and jobs[0].batch_key == jobs[1].batch_key is not None
    frames: dict[str, list[ResultFrame]] = {job.request_id: [] for job in jobs}
    items = [RenderItem(job, frames[job.request_id].append, threading.Event()) for job in jobs]
    assert not any(isinstance(outcome, RenderCancelled) for outcome in runner.render(items))
    for job in jobs:
        [batched] = [f for f in frames[job.request_id] if isinstance(f, ImageFrame)]
        [alone] = [f for f in frames_of(runner, job) if isinstance(f, ImageFrame)]
        assert np.abs(pixels(batched.data) - pixels(alone.data)).max() <= 1
        steps = [f.step for f in frames[job.request_id] if isinstance(f, ProgressFrame)]
        assert steps == [1, 2, 3]


def test_flux2_klein_takes_no_preview_its_latents_unpack_through_private_pipeline_methods():
    model = DitModel.load(FLUX2_KLEIN.path, "cpu", "float32")
    runner = Renderer(model, None, ImageEncoder(), DitMetrics(CollectorRegistry()))
    job = RenderJob("r", conditioning(some_rows(model)), params(FLUX2_KLEIN, num_inference_steps=4, partial_images=2))
    frames = frames_of(runner, job)
    assert not any(isinstance(f, PartialImageFrame) for f in frames)
    assert sum(isinstance(f, ImageFrame) for f in frames) == 1


def test_z_image_previews_are_its_clean_estimates_decoded_as_its_pipeline_decodes_and_leave_the_picture_alone(
    models,
):
    """Each preview decodes the clean latent the step predicts (``clean_latent_estimate`` of diffusers' own latents
    before and after it, read here from the reference pipeline's callback) with ZImagePipeline's own decode; the
    final picture is the one rendered without previews."""
    family, model = Z_IMAGE, models[Z_IMAGE.model]
    reference = reference_pipeline(family)
    with torch.no_grad():
        rows = family.rows(reference, PROMPT)
    runner = renderer(models, family)
    job = RenderJob("r", conditioning(rows), params(family, seed=7, num_inference_steps=4, partial_images=3))
    frames = frames_of(runner, job)
    previews = [f for f in frames if isinstance(f, PartialImageFrame)]
    [final] = [f for f in frames if isinstance(f, ImageFrame)]
    assert [(p.partial_image_index, p.step) for p in previews] == [(0, 1), (1, 2), (2, 3)]
    [alone] = [
        f
        for f in frames_of(runner, RenderJob("r", conditioning(rows), params(family, seed=7, num_inference_steps=4)))
        if isinstance(f, ImageFrame)
    ]
    assert np.array_equal(pixels(final.data), pixels(alone.data))

    latents: list[torch.Tensor] = []
    sigmas: list[float] = []

    def record(pipeline: Any, step: int, timestep: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        latents.append(tensors["latents"].clone())
        sigmas.append(float(pipeline.scheduler.sigmas[pipeline.scheduler.step_index]))
        return {}

    start = reference.prepare_latents(
        1, model.transformer.in_channels, SIZE, SIZE, torch.float32, "cpu", torch.Generator("cpu").manual_seed(7)
    )
    diffusers_picture(reference, [rows], 0.0, steps=4, callback_on_step_end=record)
    befores, first_sigma = [start, *latents[:-1]], float(reference.scheduler.sigmas[0])
    for preview, before, after, sigma_before, sigma_after in zip(
        previews, befores, latents, [first_sigma, *sigmas[:-1]], sigmas, strict=False
    ):
        clean = clean_latent_estimate(before, after, sigma_before, sigma_after)
        expected = ZImageLatents(model.vae).decode(clean, SIZE, SIZE)
        assert np.array_equal(pixels(preview.data), np.asarray(expected).astype(int))


@FAMILIES
def test_the_warm_up_render_goes_through_each_family(models, family):
    model = models[family.model]
    frames = frames_of(renderer(models, family), warmup_job(model))
    [image] = [f for f in frames if isinstance(f, ImageFrame)]
    size = model.facts.size_multiple
    assert pixels(image.data).shape == (size, size, 3)


def test_a_folder_whose_text_encoder_lacks_the_layers_its_card_reads_fails_to_load_naming_them(tmp_path):
    folder = tmp_path / "flux2-klein-short"
    source = require_checkpoint(default_model_dir(FLUX2_KLEIN_MODEL))
    for part in source.iterdir():
        (folder / part.name).parent.mkdir(parents=True, exist_ok=True)
        if part.name == "text_encoder":
            (folder / part.name).mkdir()
            config = json.loads((part / "config.json").read_text()) | {"num_hidden_layers": 20}
            (folder / part.name / "config.json").write_text(json.dumps(config))
        else:
            (folder / part.name).symlink_to(part)
    with pytest.raises(ValueError, match=r"layers \[27\]: the text encoder has 20 layers"):
        DitModel.load(folder, "cpu", "float32")
