"""One render job through diffusers: image by image, previews on the way, stoppable between steps.

``render`` is synchronous and meant for a worker thread; it hands result frames to ``emit`` as they
are ready (progress after every denoising step, previews during denoising, each final image as
soon as it is encoded). Image ``i`` uses
seed ``seed + i`` and its own generator, so an image does not depend on how many were asked for.

A job with an edit runs Qwen-Image's img2img pipeline (inpaint with a mask) from the image's
latents, encoded once per job; see ``edit_input`` for what strength and the mask guarantee.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers import QwenImagePipeline
from prometheus_client import Histogram

from dit_service.conditioning import Conditioning
from dit_service.edit_input import EditInput
from dit_service.handoff_trace import HandoffTrace
from dit_service.image_encoder import ImageEncoder
from dit_service.latent_decoder import LatentDecoder
from dit_service.latent_encoder import LatentEncoder
from dit_service.metrics import DitMetrics
from dit_service.model import DitModel, Pipeline, PipelineKind
from dit_service.previews import clean_latent_estimate, preview_steps
from shared.frames import DiffusionParams
from shared.result_frames import ImageFrame, PartialImageFrame, ProgressFrame

EmitResult = Callable[[PartialImageFrame | ImageFrame | ProgressFrame], None]


@dataclass(frozen=True)
class RenderJob:
    request_id: str
    conditioning: Conditioning
    params: DiffusionParams
    edit: EditInput | None = None
    trace: HandoffTrace = field(default_factory=HandoffTrace)

    @property
    def denoising_steps(self) -> int:
        """Steps each image runs (an edit runs the last part of its schedule)."""
        steps = self.params.num_inference_steps
        return steps if self.edit is None else self.edit.denoising_steps(steps)


@dataclass(frozen=True)
class _EditLatents:
    """What an edit's pipeline call starts from, encoded once for all images of the job."""

    image: torch.Tensor
    masked_image: torch.Tensor | None


@dataclass
class RenderTimings:
    """Seconds summed over a job's images. Preview work happens inside denoising but is kept apart."""

    vae_encode: float = 0.0  # an edit's image, once per job
    denoise: float = 0.0
    vae_decode: float = 0.0
    encode: float = 0.0
    previews: float = 0.0


class RenderCancelled(Exception):
    """The consumer went away; the run stopped at the next denoising step."""


class StepCallback:
    """``callback_on_step_end``: times each step, stops an abandoned run, reports progress, takes
    the previews (of the whole batch the pipeline denoises).

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

    def __call__(
        self, pipeline: Pipeline, step: int, timestep: torch.Tensor, tensors: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        self._step_seconds.observe(time.perf_counter() - self._step_started)
        latents = tensors["latents"]
        if self._abandoned():
            # The documented way to stop a diffusers loop: remaining steps are skipped.
            pipeline._interrupt = True
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


class PipelineRunner:
    def __init__(self, model: DitModel, decoder: LatentDecoder, encoder: ImageEncoder, metrics: DitMetrics) -> None:
        self._model = model
        self._decoder = decoder
        self._encoder = encoder
        self._metrics = metrics
        self._latent_encoder = LatentEncoder(model)

    def render(self, job: RenderJob, emit: EmitResult, cancel: threading.Event) -> RenderTimings:
        timings = RenderTimings()
        inputs = self._pipeline_inputs(job.conditioning, job.params.guidance_scale)
        started = time.perf_counter()
        edit_latents = self._edit_latents(job.edit) if job.edit is not None else None
        timings.vae_encode = time.perf_counter() - started
        for index in range(job.params.num_images):
            if cancel.is_set():
                raise RenderCancelled()
            self._render_image(job, index, inputs, edit_latents, emit, cancel, timings)
        return timings

    def _edit_latents(self, edit: EditInput) -> _EditLatents:
        encoder = self._latent_encoder
        pixels = encoder.pixels(edit.image)
        if edit.mask is None:
            return _EditLatents(encoder.encode(pixels), None)
        # The inpaint pipeline's masked image: the input with the repainted region blanked out.
        keep = torch.from_numpy(np.asarray(edit.mask) == 0)[None, None]
        return _EditLatents(encoder.encode(pixels), encoder.encode(pixels * keep))

    @staticmethod
    def _edit_inputs(edit: EditInput, latents: _EditLatents) -> tuple[PipelineKind, dict[str, Any]]:
        """The edit pipeline and what it takes beyond the text-to-image call."""
        inputs: dict[str, Any] = {"image": latents.image, "strength": edit.strength}
        if edit.mask is None:
            return "image_to_image", inputs
        return "inpaint", {**inputs, "mask_image": edit.mask, "masked_image_latents": latents.masked_image}

    def _pipeline_inputs(self, conditioning: Conditioning, guidance_scale: float) -> dict[str, Any]:
        device = self._model.facts.device
        inputs: dict[str, Any] = {
            "prompt_embeds": conditioning.prompt_embeds.to(device),
            "prompt_embeds_mask": conditioning.prompt_embeds_mask.to(device),
            "true_cfg_scale": 1.0,
        }
        lengths = [conditioning.prompt_embeds.shape[1]]
        negative, negative_mask = conditioning.negative_prompt_embeds, conditioning.negative_prompt_embeds_mask
        if negative is not None and negative_mask is not None and guidance_scale > 1.0:
            inputs["negative_prompt_embeds"] = negative.to(device)
            inputs["negative_prompt_embeds_mask"] = negative_mask.to(device)
            inputs["true_cfg_scale"] = guidance_scale
            lengths.append(negative.shape[1])
        # The adapter already enforced the service's limit; this only stops diffusers cutting anything.
        inputs["max_sequence_length"] = max(lengths)
        return inputs

    def _render_image(
        self,
        job: RenderJob,
        index: int,
        inputs: dict[str, Any],
        edit_latents: _EditLatents | None,
        emit: EmitResult,
        cancel: threading.Event,
        timings: RenderTimings,
    ) -> None:
        params, edit = job.params, job.edit
        seed = params.seed + index
        generator = torch.Generator("cpu").manual_seed(seed)
        kind: PipelineKind = "text_to_image"
        if edit is not None and edit_latents is not None:
            kind, edit_inputs = self._edit_inputs(edit, edit_latents)
            inputs = {**inputs, **edit_inputs}
        pipeline = self._model.new_pipeline(kind)
        preview_count = 0
        preview_seconds = 0.0

        def finished(latents: torch.Tensor) -> PIL.Image.Image:
            image = self._decoder.decode(latents, params.height, params.width)
            if edit is not None and edit.mask is not None:
                # Outside the mask the answer is the input's own pixels, not their VAE round trip.
                image = pipeline.image_processor.apply_overlay(edit.mask, edit.image, image)
            return image

        def on_preview(step: int, clean: torch.Tensor) -> None:
            nonlocal preview_count, preview_seconds
            started = time.perf_counter()
            image = finished(clean)
            data = self._encoder.encode(image, params.output_format, params.output_compression)
            emit(
                PartialImageFrame(
                    request_id=job.request_id,
                    image_index=index,
                    partial_image_index=preview_count,
                    step=step + 1,
                    output_format=params.output_format,
                    data=data,
                )
            )
            preview_count += 1
            preview_seconds += time.perf_counter() - started

        steps = job.denoising_steps

        def on_step(step: int) -> None:
            done = index * steps + step + 1
            emit(ProgressFrame(request_id=job.request_id, step=done, steps=steps * params.num_images))

        started = time.perf_counter()
        with job.trace.stage("denoise", image_index=index, steps=steps):
            if steps == 0 and edit_latents is not None:
                # Nothing to denoise (strength 0): the image's own latents, decoded.
                final_latents = QwenImagePipeline._pack_latents(edit_latents.image, 1, *edit_latents.image.shape[1:])
            else:
                previews = preview_steps(steps, params.partial_images)
                step_seconds = self._metrics.denoise_step_seconds
                callback = StepCallback(previews, on_preview, on_step, cancel.is_set, step_seconds)
                callback.record_start(pipeline)
                final_latents = pipeline(
                    height=params.height,
                    width=params.width,
                    num_inference_steps=params.num_inference_steps,
                    generator=generator,
                    output_type="latent",
                    callback_on_step_end=callback,
                    callback_on_step_end_tensor_inputs=["latents"],
                    **inputs,
                ).images
        denoise = time.perf_counter() - started - preview_seconds
        if cancel.is_set():
            raise RenderCancelled()

        started = time.perf_counter()
        with job.trace.stage("vae_decode", image_index=index):
            image = finished(final_latents)
        decoded = time.perf_counter()
        with job.trace.stage("encode", image_index=index, format=params.output_format):
            data = self._encoder.encode(image, params.output_format, params.output_compression)
        encoded = time.perf_counter()

        timings.denoise += denoise
        timings.previews += preview_seconds
        timings.vae_decode += decoded - started
        timings.encode += encoded - decoded
        self._metrics.denoise_seconds.observe(denoise)
        self._metrics.vae_decode_seconds.observe(decoded - started)
        self._metrics.encode_seconds.observe(encoded - decoded)
        self._metrics.images.labels(params.output_format).inc()
        self._metrics.image_pixels.observe(image.width * image.height)
        emit(
            ImageFrame(
                request_id=job.request_id,
                image_index=index,
                seed=seed,
                width=image.width,
                height=image.height,
                output_format=params.output_format,
                data=data,
            )
        )
