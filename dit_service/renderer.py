"""Render jobs through diffusers: one job, or several compatible ones denoised as one batch.

``Renderer.render(items)`` is the DiT's pipeline call, in the numbered steps of diffusers' own
``__call__``: (1) check the items may share a run, (2) build each job's inputs (conditioning in the form
the family's pipeline takes it, CFG, an edit's latents or a reference edit's pictures), (3) denoise each
round of images with the step callback (progress, previews, stopping an abandoned run), (4) finish each
image (decode, paste an edit's unmasked pixels back, encode, emit). A job's step cache (``step_cache``)
is on for its pipeline calls only. It is synchronous and meant for a worker thread; result frames go to
each item's ``emit`` as soon as they exist.

Qwen-Image's pipelines return latents and the service decodes them (``VaeCodec``: previews and edits
decode and encode the same way; a reference edit's pipeline encodes its pictures itself, under the shared
VAE's lock, inside its ``denoise`` time); the other families' pipelines decode their own picture, so their
``denoise`` time holds the decode, and Z-Image's previews are decoded as its pipeline decodes
(``ZImageLatents``; ``services.model_card``).

A round is the images denoised by one pipeline call. A job's image ``i`` uses seed ``seed + i`` and
its own generator, so an image does not depend on how many were asked for; a job with ``n`` images
runs ``n`` rounds of one. Jobs that share a ``batch_key`` (one image each, no edit) run as one
round, each conditioning right-padded with a mask to the round's longest: a batched image equals
the same request rendered alone up to float rounding in the batched, masked attention (measured in
tests/dit_service/test_renderer.py). A job whose consumer left is dropped from what is emitted at
once; the run stops only when every job of the round has left.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import PIL.Image
import torch
from prometheus_client import Histogram

from dit_service.conditioning import Conditioning
from dit_service.family_classes import LatentDecoder
from dit_service.image_encoder import ImageEncoder
from dit_service.metrics import DitMetrics
from dit_service.model import DitModel, Pipeline
from dit_service.previews import clean_latent_estimate, preview_steps
from dit_service.render_job import (
    RenderCancelled,
    RenderItem,
    RenderJob,
    RenderOutcome,
    RenderTimings,
)
from dit_service.step_cache import step_cache
from dit_service.vae_codec import VaeCodec
from services.model_card import PipelineKind
from shared.diffusion import DiffusionParams
from shared.result_frames import ImageFrame, PartialImageFrame, ProgressFrame

# What a pipeline call gives for one image: its packed latents [1, patches, channels], or the picture where
# the family's pipeline decodes it.
Output = torch.Tensor | PIL.Image.Image


@dataclass(frozen=True)
class _Image:
    """One image of one item: ``position`` in the items, ``index`` among its job's images."""

    position: int
    index: int


@dataclass(frozen=True)
class _Round:
    """The images one pipeline call denoises (one row of latents each), and where their frames go."""

    items: Sequence[RenderItem]
    images: list[_Image]
    timings: list[RenderTimings]

    @classmethod
    def of(cls, items: Sequence[RenderItem], images: list[_Image], timings: list[RenderTimings]) -> _Round:
        """The round of ``images`` whose consumers are still there."""
        return cls(items, [image for image in images if not items[image.position].cancel.is_set()], timings)

    @property
    def jobs(self) -> list[RenderJob]:
        return [self.items[image.position].job for image in self.images]

    def present(self) -> list[tuple[int, _Image, RenderItem]]:
        """(row in the latents, image, item) of the images whose consumer is still there now."""
        rows = [(row, image, self.items[image.position]) for row, image in enumerate(self.images)]
        return [(row, image, item) for row, image, item in rows if not item.cancel.is_set()]

    def abandoned(self) -> bool:
        return not self.present()

    def progress(self, step: int) -> None:
        for _, image, item in self.present():
            steps, count = item.job.denoising_steps, item.job.params.num_images
            done = image.index * steps + step + 1
            item.emit(ProgressFrame(request_id=item.job.request_id, step=done, steps=steps * count))


@dataclass(frozen=True)
class Renderer:
    model: DitModel
    # What decodes the family's latents here (its card's ``latents``: previews, and Qwen-Image's finals and edits); None
    # for a family that has none (FLUX.2: no previews, its pipeline decodes its pictures).
    vae: LatentDecoder | None
    encoder: ImageEncoder
    metrics: DitMetrics

    @property
    def batches(self) -> bool:
        """Whether jobs of this model may share a pipeline run (its model card's)."""
        return self.model.card.batches

    def render(self, items: Sequence[RenderItem]) -> list[RenderOutcome]:
        """One outcome per item: its timings, or ``RenderCancelled`` if its consumer left."""
        # 1. check: a run is one job, or jobs that agree on everything the denoising loop shares.
        jobs = [item.job for item in items]
        key = jobs[0].batch_key
        if len(jobs) > 1 and (not self.batches or key is None or any(j.batch_key != key for j in jobs)):
            raise ValueError("these jobs cannot share a batch")
        timings = [RenderTimings() for _ in items]
        # 2. inputs: an edit's latents (encoded once per job).
        kind, edit_inputs = self._edit_inputs(jobs[0], timings[0])
        images = [[_Image(p, 0) for p in range(len(items))]] if len(items) > 1 else _one_by_one(jobs[0])
        for round_images in images:
            round = _Round.of(items, round_images, timings)
            if not round.images:
                continue
            # 3. latents → denoise, with the step callback; the conditioning of the round's jobs.
            inputs = {**self._conditioning(round.jobs), **edit_inputs}
            outputs = self._denoise(round, kind, inputs)
            if outputs is None:
                continue  # every consumer left mid-run
            # 4. finish each image whose consumer is still there.
            for row, image, item in round.present():
                self._finish(item, image.index, outputs[row], timings[image.position])
        return [RenderCancelled() if item.cancel.is_set() else t for item, t in zip(items, timings, strict=True)]

    def _edit_inputs(self, job: RenderJob, timings: RenderTimings) -> tuple[PipelineKind, dict[str, Any]]:
        """The pipeline a job runs and what it takes beyond the text-to-image call (an edit's latents, a reference
        edit's pictures)."""
        edit = job.edit
        if edit is None:
            return "text_to_image", {}
        if not self.model.card.edits:
            raise ValueError(f"{self.model.card.family}: this DiT does not edit images")
        if edit.strength is None:
            # The pipeline VAE-encodes each picture itself at the 1024x1024 area (its card's ``vae_size``). The AR
            # sends each picture at that size already, so the pipeline's resize is the identity (PIL returns a copy
            # for an equal size) and the picture is encoded as the AR sized it.
            return "reference_edit", {"image": list(edit.pictures)}
        if not self.model.card.service_decodes:
            # Its pipeline encodes the picture and decodes its answer itself (Z-Image's, FLUX.2's): given the picture
            # as the AR sent it (Z-Image's at the output size, so its resize is the identity) and the mask as diffusers
            # reads one (white repaints); FLUX.2's inpaint reads the other pictures as references.
            if edit.mask is None:
                return "image_to_image", {"image": edit.pictures[0], "strength": edit.strength}
            inpaint: dict[str, Any] = {"image": edit.pictures[0], "mask_image": edit.mask, "strength": edit.strength}
            if len(edit.pictures) > 1:
                inpaint["image_reference"] = list(edit.pictures[1:])
            return "inpaint", inpaint
        started = time.perf_counter()
        vae = self._codec
        pixels = vae.pixels(edit.pictures[0])
        inputs: dict[str, Any] = {"image": vae.encode(pixels), "strength": edit.strength}
        kind: PipelineKind = "image_to_image"
        if edit.mask is not None:
            # The inpaint pipeline's masked image: the input with the repainted region blanked out.
            keep = torch.from_numpy(np.asarray(edit.mask) == 0)[None, None]
            inputs |= {"mask_image": edit.mask, "masked_image_latents": vae.encode(pixels * keep)}
            kind = "inpaint"
        timings.vae_encode = time.perf_counter() - started
        return kind, inputs

    def _conditioning(self, jobs: list[RenderJob]) -> dict[str, Any]:
        """The round's rows as the family's pipeline takes them, and its guidance."""
        device, params = self.model.facts.device, jobs[0].params
        cond = [job.conditioning for job in jobs]
        form: Callable[[list[torch.Tensor]], list[torch.Tensor] | torch.Tensor]
        match self.model.card.prompt_embeds:
            case "padded_with_mask":
                return self._padded_conditioning(cond, params)
            case "list_of_rows":
                form = functools.partial(_listed, device=device)
            case "rows":
                form = functools.partial(_stacked, device=device)
        inputs: dict[str, Any] = {
            "prompt_embeds": form([_valid_rows(c.prompt_embeds, c.prompt_embeds_mask) for c in cond]),
            "guidance_scale": params.guidance_scale,
        }
        if params.cfg:
            inputs["negative_prompt_embeds"] = form([_valid_rows(*_negative(c)) for c in cond])
        return inputs

    def _padded_conditioning(self, cond: list[Conditioning], params: DiffusionParams) -> dict[str, Any]:
        """Each job's rows, right-padded to the round's longest with a mask; the negative ones with CFG."""
        device = self.model.facts.device
        embeds, mask = _padded([(c.prompt_embeds, c.prompt_embeds_mask) for c in cond])
        inputs: dict[str, Any] = {
            "prompt_embeds": embeds.to(device),
            "prompt_embeds_mask": mask.to(device),
            "true_cfg_scale": 1.0,
            # The adapter already enforced the service's limit; this only stops diffusers cutting anything.
            "max_sequence_length": embeds.shape[1],
        }
        if params.cfg:
            negatives = [(c.negative_prompt_embeds, c.negative_prompt_embeds_mask) for c in cond]
            pairs = [(e, m) for e, m in negatives if e is not None and m is not None]
            if len(pairs) != len(negatives):
                raise ValueError("CFG needs every job's negative conditioning")
            negative, negative_mask = _padded(pairs)
            inputs |= {
                "negative_prompt_embeds": negative.to(device),
                "negative_prompt_embeds_mask": negative_mask.to(device),
                "true_cfg_scale": params.guidance_scale,
                "max_sequence_length": max(embeds.shape[1], negative.shape[1]),
            }
        return inputs

    def _denoise(self, round: _Round, kind: PipelineKind, inputs: dict[str, Any]) -> list[Output] | None:
        """The round's outputs, one per image of the round; None when every consumer left mid-run."""
        # Every job of a round agrees on what the denoising loop shares.
        params, steps = round.jobs[0].params, round.jobs[0].denoising_steps
        card = self.model.card
        images = [(image, round.items[image.position]) for image in round.images]
        # Previews decode the latents mid-run: only where the service decodes them.
        preview_at = preview_steps(steps, params.partial_images) if card.previews else ()
        callback = StepCallback(
            preview_at,
            functools.partial(self._previews, round),
            round.progress,
            round.abandoned,
            self.metrics.denoise_step_seconds,
        )
        previews_before = sum(round.timings[image.position].previews for image in round.images)
        started = time.perf_counter()
        with contextlib.ExitStack() as stages:
            for image, item in images:
                stages.enter_context(item.job.trace.stage("denoise", image_index=image.index, steps=steps))
            # The pipeline's images: packed latents [images, patches, channels], or its own pictures.
            result: Any
            if steps == 0:
                result = self._codec.packed(inputs["image"])  # strength 0: the input's own latents, decoded
            else:
                pipeline = self._pipeline(kind, callback if preview_at else None)
                if not _takes(pipeline, "max_sequence_length"):
                    # Qwen-Image-2.1's ``__call__`` cuts no rows, so it takes no such limit.
                    inputs = {name: value for name, value in inputs.items() if name != "max_sequence_length"}
                seeds = [item.job.params.seed + image.index for image, item in images]
                stages.enter_context(
                    step_cache(self.model.transformer, params.step_cache, self.metrics.step_cache_passes)
                )
                result = pipeline(
                    height=params.height,
                    width=params.width,
                    num_inference_steps=params.num_inference_steps,
                    sigmas=params.sigmas,
                    generator=[torch.Generator("cpu").manual_seed(seed) for seed in seeds],
                    output_type="latent" if card.service_decodes else "pil",
                    callback_on_step_end=callback,
                    callback_on_step_end_tensor_inputs=["latents"],
                    **inputs,
                ).images
        previews = sum(round.timings[image.position].previews for image in round.images) - previews_before
        denoise = time.perf_counter() - started - previews
        self.metrics.denoise_seconds.observe(denoise)
        for image in round.images:
            round.timings[image.position].denoise += denoise
        if callback.interrupted:
            return None
        if card.service_decodes:
            return [result[row : row + 1] for row in range(len(round.images))]
        pictures: list[Output] = result
        return pictures

    def _pipeline(self, kind: PipelineKind, previews: StepCallback | None) -> Pipeline:
        """This run's own pipeline of ``kind``, keeping its start latents for ``previews`` where they are taken."""
        pipeline = self.model.new_pipeline(kind)
        if previews is not None:
            previews.record_start(pipeline)
        return pipeline

    def _previews(self, round: _Round, step: int, clean: torch.Tensor) -> None:
        for row, image, item in round.present():
            started = time.perf_counter()
            job, params = item.job, item.job.params
            picture = self._picture(job, clean[row : row + 1])
            frame = PartialImageFrame(
                request_id=job.request_id,
                image_index=image.index,
                # The k-th preview of an image is taken at the k-th step of its schedule.
                partial_image_index=preview_steps(job.denoising_steps, params.partial_images).index(step),
                step=step + 1,
                output_format=params.output_format,
                data=self.encoder.encode(picture, params.output_format, params.output_compression),
            )
            item.emit(frame)
            round.timings[image.position].previews += time.perf_counter() - started

    def _picture(self, job: RenderJob, output: Output) -> PIL.Image.Image:
        """A pipeline's output → the picture the client gets (an edit's unmasked pixels are the input's own)."""
        if isinstance(output, PIL.Image.Image):
            return output  # decoded by the family's pipeline
        if self.vae is None:
            raise ValueError(f"{self.model.card.family}: this renderer decodes no latents (its pipeline does)")
        image = self.vae.decode(output, job.params.height, job.params.width)
        edit = job.edit
        if edit is not None and edit.mask is not None:
            image = self._codec.pasted_back(image, edit.mask, edit.pictures[0])
        return image

    @property
    def _codec(self) -> VaeCodec:
        """Qwen-Image's codec, which edits need (its encode and paste-back)."""
        if not isinstance(self.vae, VaeCodec):
            raise ValueError(f"{self.model.card.family}: this renderer has no VAE codec (its pipeline decodes)")
        return self.vae

    def _finish(self, item: RenderItem, index: int, output: Output, timings: RenderTimings) -> None:
        job, params, metrics = item.job, item.job.params, self.metrics
        started = time.perf_counter()
        with job.trace.stage("vae_decode", image_index=index):
            image = self._picture(job, output)
        decoded = time.perf_counter()
        with job.trace.stage("encode", image_index=index, format=params.output_format):
            data = self.encoder.encode(image, params.output_format, params.output_compression)
        encoded = time.perf_counter()
        timings.vae_decode += decoded - started
        timings.encode += encoded - decoded
        metrics.vae_decode_seconds.observe(decoded - started)
        metrics.encode_seconds.observe(encoded - decoded)
        metrics.images.labels(params.output_format).inc()
        metrics.image_pixels.observe(image.width * image.height)
        frame = ImageFrame(
            request_id=job.request_id,
            image_index=index,
            seed=params.seed + index,
            width=image.width,
            height=image.height,
            output_format=params.output_format,
            data=data,
        )
        item.emit(frame)


def _one_by_one(job: RenderJob) -> list[list[_Image]]:
    return [[_Image(0, index)] for index in range(job.params.num_images)]


def _takes(pipeline: Pipeline, argument: str) -> bool:
    """Whether the pipeline's ``__call__`` takes ``argument``."""
    return argument in inspect.signature(pipeline.__call__).parameters


def _valid_rows(embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[L_valid, D]: the rows of [1, L, D] ``embeds`` the mask keeps (valid rows come first, pads after)."""
    return embeds[0, mask[0].bool()]


def _negative(conditioning: Conditioning) -> tuple[torch.Tensor, torch.Tensor]:
    embeds, mask = conditioning.negative_prompt_embeds, conditioning.negative_prompt_embeds_mask
    if embeds is None or mask is None:
        raise ValueError("CFG needs every job's negative conditioning")
    return embeds, mask


def _listed(rows: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Z-Image's form: one [L_i, D] tensor of each image's rows."""
    return [r.to(device) for r in rows]


def _stacked(rows: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """FLUX.2's form: [B, L, D] of the rows alone (one length: its jobs never share a run)."""
    return torch.stack(rows).to(device)


def _padded(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, L_i, D] embeds and [1, L_i] masks → [B, max L, D] and [B, max L], valid rows first."""
    length = max(embeds.shape[1] for embeds, _ in pairs)
    first = pairs[0][0]
    embeds = first.new_zeros((len(pairs), length, first.shape[2]))
    masks = torch.zeros((len(pairs), length), dtype=pairs[0][1].dtype)
    for row, (e, m) in enumerate(pairs):
        embeds[row, : e.shape[1]] = e[0]
        masks[row, : m.shape[1]] = m[0]
    return embeds, masks


class StepCallback:
    """``callback_on_step_end``: times each step, stops an abandoned run, reports progress, takes
    the previews (of the whole round the pipeline denoises).

    A step is timed from the end of the previous callback (so preview work is not counted) to the
    start of this one; the first from the callback's creation, just before the pipeline call.
    """

    def __init__(
        self,
        previews: tuple[int, ...],
        on_preview: Callable[[int, torch.Tensor], None],
        on_step: Callable[[int], None],
        abandoned: Callable[[], bool],
        step_seconds: Histogram,
    ) -> None:
        """``abandoned``: True when nobody waits for the result any more (the loop then stops)."""
        self._previous: torch.Tensor | None = None  # the latents before the step (``record_start``)
        self._previews = previews
        self._on_preview = on_preview
        self._on_step = on_step
        self._abandoned = abandoned
        self._step_seconds = step_seconds
        self._step_started = time.perf_counter()
        self.interrupted = False

    def __call__(
        self, pipeline: Pipeline, step: int, timestep: torch.Tensor, tensors: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        self._step_seconds.observe(time.perf_counter() - self._step_started)
        latents = tensors["latents"]
        if self._abandoned():
            # The documented way to stop a diffusers loop: remaining steps are skipped.
            pipeline._interrupt = True
            self.interrupted = True
            return {}
        self._on_step(step)
        if step in self._previews and self._previous is not None:
            # The scheduler has stepped: its index is one past the step just taken (an edit's
            # schedule starts part-way, so ``step`` is not that index).
            scheduler = pipeline.scheduler
            after = scheduler.step_index
            sigma_before, sigma_after = float(scheduler.sigmas[after - 1]), float(scheduler.sigmas[after])
            self._on_preview(step, clean_latent_estimate(self._previous, latents, sigma_before, sigma_after))
        self._previous = latents
        self._step_started = time.perf_counter()
        return {}

    def record_start(self, pipeline: Pipeline) -> None:
        """Keep the latents the pipeline starts from (previews need the latents before each step).

        Wraps ``prepare_latents`` of this request's own pipeline object, so nothing is duplicated
        of how each pipeline prepares them (text to image, img2img and inpaint all differ).
        """
        prepare = pipeline.prepare_latents

        def prepared(*args: Any, **kwargs: Any) -> Any:
            result = prepare(*args, **kwargs)
            self._previous = result[0] if isinstance(result, tuple) else result  # inpaint adds noise, image
            return result

        pipeline.prepare_latents = prepared
