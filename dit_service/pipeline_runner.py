"""One render job through diffusers: image by image, previews on the way, stoppable between steps.

``render`` is synchronous and meant for a worker thread; it hands result frames to ``emit`` as they
are ready (progress after every denoising step, previews during denoising, each final image as
soon as it is encoded). Image ``i`` uses
seed ``seed + i`` and its own generator, so an image does not depend on how many were asked for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from prometheus_client import Histogram

from dit_service.conditioning import Conditioning
from dit_service.handoff_trace import HandoffTrace
from dit_service.image_encoder import ImageEncoder
from dit_service.latent_decoder import LatentDecoder
from dit_service.metrics import DitMetrics
from dit_service.model import DitModel, Pipeline
from dit_service.previews import clean_latent_estimate, preview_steps
from shared.frames import DiffusionParams
from shared.result_frames import ImageFrame, PartialImageFrame, ProgressFrame

EmitResult = Callable[[PartialImageFrame | ImageFrame | ProgressFrame], None]


@dataclass(frozen=True)
class RenderJob:
    request_id: str
    conditioning: Conditioning
    params: DiffusionParams
    trace: HandoffTrace = field(default_factory=HandoffTrace)


@dataclass
class RenderTimings:
    """Seconds summed over a job's images. Preview work happens inside denoising but is kept apart."""

    denoise: float = 0.0
    vae_decode: float = 0.0
    encode: float = 0.0
    previews: float = 0.0


class RenderCancelled(Exception):
    """The consumer went away; the run stopped at the next denoising step."""


class _StepCallback:
    """``callback_on_step_end``: times each step, stops an abandoned run, reports progress, takes the
    scheduled previews.

    A step is timed from the end of the previous callback (so preview work is not counted) to the
    start of this one; the first from the callback's creation, just before the pipeline call.
    """

    def __init__(
        self,
        initial_latents: torch.Tensor,
        previews: tuple[int, ...],
        on_preview: Callable[[int, torch.Tensor], None],
        on_step: Callable[[int], None],
        cancel: threading.Event,
        step_seconds: Histogram,
    ) -> None:
        self._previous = initial_latents
        self._previews = previews
        self._on_preview = on_preview
        self._on_step = on_step
        self._cancel = cancel
        self._step_seconds = step_seconds
        self._step_started = time.perf_counter()

    def __call__(
        self, pipeline: Pipeline, step: int, timestep: torch.Tensor, tensors: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        self._step_seconds.observe(time.perf_counter() - self._step_started)
        latents = tensors["latents"]
        if self._cancel.is_set():
            # The documented way to stop a diffusers loop: remaining steps are skipped.
            pipeline._interrupt = True
            return {}
        self._on_step(step)
        if step in self._previews:
            sigmas = pipeline.scheduler.sigmas
            clean = clean_latent_estimate(self._previous, latents, float(sigmas[step]), float(sigmas[step + 1]))
            self._on_preview(step, clean)
        self._previous = latents
        self._step_started = time.perf_counter()
        return {}


class PipelineRunner:
    def __init__(self, model: DitModel, decoder: LatentDecoder, encoder: ImageEncoder, metrics: DitMetrics) -> None:
        self._model = model
        self._decoder = decoder
        self._encoder = encoder
        self._metrics = metrics

    def render(self, job: RenderJob, emit: EmitResult, cancel: threading.Event) -> RenderTimings:
        timings = RenderTimings()
        inputs = self._pipeline_inputs(job.conditioning, job.params.guidance_scale)
        for index in range(job.params.num_images):
            if cancel.is_set():
                raise RenderCancelled()
            self._render_image(job, index, inputs, emit, cancel, timings)
        return timings

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
        emit: EmitResult,
        cancel: threading.Event,
        timings: RenderTimings,
    ) -> None:
        params = job.params
        seed = params.seed + index
        pipeline = self._model.new_pipeline()
        generator = torch.Generator("cpu").manual_seed(seed)
        # The same call the pipeline would make; done here so the previews know the starting latents.
        latents = pipeline.prepare_latents(
            1,
            self._model.latent_channels,
            params.height,
            params.width,
            inputs["prompt_embeds"].dtype,
            self._model.facts.device,
            generator,
        )
        preview_count = 0
        preview_seconds = 0.0

        def on_preview(step: int, clean: torch.Tensor) -> None:
            nonlocal preview_count, preview_seconds
            started = time.perf_counter()
            image = self._decoder.decode(clean, params.height, params.width)
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

        steps = params.num_inference_steps

        def on_step(step: int) -> None:
            done = index * steps + step + 1
            emit(ProgressFrame(request_id=job.request_id, step=done, steps=steps * params.num_images))

        previews = preview_steps(steps, params.partial_images)
        callback = _StepCallback(latents, previews, on_preview, on_step, cancel, self._metrics.denoise_step_seconds)
        started = time.perf_counter()
        with job.trace.stage("denoise", image_index=index, steps=params.num_inference_steps):
            final_latents = pipeline(
                height=params.height,
                width=params.width,
                num_inference_steps=params.num_inference_steps,
                latents=latents,
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
            image = self._decoder.decode(final_latents, params.height, params.width)
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
