"""Several text-to-image jobs denoised as one batch: one pipeline call, each job with its own seed,
conditioning (right-padded with a mask to the batch's longest) and output.

Only jobs that agree on what the denoising loop shares can be batched: size, steps, guidance and
preview steps (``batch_key``); each must ask for one image and no edit. Image ``i`` of the batch
starts from the noise its own seed gives (diffusers draws each batch element with its own
generator), so a batched image equals the same request rendered alone up to float rounding in the
batched, masked attention (measured in tests/dit_service/test_batch_runner.py).

A job whose consumer left is dropped from what is emitted at once; the batch keeps denoising for
the others, and stops only when every job has left.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dit_service.conditioning import Conditioning
from dit_service.image_encoder import ImageEncoder
from dit_service.latent_decoder import LatentDecoder
from dit_service.metrics import DitMetrics
from dit_service.model import DitModel
from dit_service.pipeline_runner import EmitResult, RenderCancelled, RenderJob, RenderTimings, StepCallback
from dit_service.previews import preview_steps
from shared.result_frames import ImageFrame, PartialImageFrame, ProgressFrame

BatchKey = tuple[int, int, int, float, int]


@dataclass(frozen=True)
class BatchItem:
    job: RenderJob
    emit: EmitResult
    cancel: threading.Event


def batch_key(job: RenderJob) -> BatchKey | None:
    """What a batch must share; None for a job that is rendered on its own."""
    p = job.params
    if job.edit is not None or p.num_images != 1:
        return None
    return (p.width, p.height, p.num_inference_steps, p.guidance_scale, p.partial_images)


class BatchRunner:
    def __init__(self, model: DitModel, decoder: LatentDecoder, encoder: ImageEncoder, metrics: DitMetrics) -> None:
        self._model = model
        self._decoder = decoder
        self._encoder = encoder
        self._metrics = metrics

    def render(self, items: Sequence[BatchItem]) -> list[RenderTimings | RenderCancelled]:
        """Synchronous (a worker thread). One result per item: its timings, or RenderCancelled."""
        jobs = [item.job for item in items]
        params = jobs[0].params
        if any(batch_key(job) != batch_key(jobs[0]) or batch_key(job) is None for job in jobs):
            raise ValueError("these jobs cannot share a batch")
        pipeline = self._model.new_pipeline("text_to_image")
        steps = params.num_inference_steps
        timings = [RenderTimings() for _ in items]
        preview_counts = [0] * len(items)

        def on_step(step: int) -> None:
            for item in items:
                if not item.cancel.is_set():
                    item.emit(ProgressFrame(request_id=item.job.request_id, step=step + 1, steps=steps))

        def on_preview(step: int, clean: torch.Tensor) -> None:
            for position, item in enumerate(items):
                if item.cancel.is_set():
                    continue
                started = time.perf_counter()
                image = self._decoder.decode(clean[position : position + 1], params.height, params.width)
                job = item.job
                data = self._encoder.encode(image, job.params.output_format, job.params.output_compression)
                item.emit(
                    PartialImageFrame(
                        request_id=job.request_id,
                        image_index=0,
                        partial_image_index=preview_counts[position],
                        step=step + 1,
                        output_format=job.params.output_format,
                        data=data,
                    )
                )
                preview_counts[position] += 1
                timings[position].previews += time.perf_counter() - started

        callback = StepCallback(
            preview_steps(steps, params.partial_images),
            on_preview,
            on_step,
            lambda: all(item.cancel.is_set() for item in items),
            self._metrics.denoise_step_seconds,
        )
        callback.record_start(pipeline)
        started = time.perf_counter()
        final_latents = pipeline(
            height=params.height,
            width=params.width,
            num_inference_steps=steps,
            generator=[torch.Generator("cpu").manual_seed(job.params.seed) for job in jobs],
            output_type="latent",
            callback_on_step_end=callback,
            callback_on_step_end_tensor_inputs=["latents"],
            **self._inputs([job.conditioning for job in jobs], params.guidance_scale),
        ).images
        denoise = time.perf_counter() - started - sum(t.previews for t in timings)
        self._metrics.denoise_seconds.observe(denoise)
        results: list[RenderTimings | RenderCancelled] = []
        for position, item in enumerate(items):
            if item.cancel.is_set():
                results.append(RenderCancelled())
                continue
            timings[position].denoise = denoise
            self._finish(item, final_latents[position : position + 1], timings[position])
            results.append(timings[position])
        return results

    def _finish(self, item: BatchItem, latents: torch.Tensor, timings: RenderTimings) -> None:
        job, params = item.job, item.job.params
        started = time.perf_counter()
        image = self._decoder.decode(latents, params.height, params.width)
        decoded = time.perf_counter()
        data = self._encoder.encode(image, params.output_format, params.output_compression)
        encoded = time.perf_counter()
        timings.vae_decode, timings.encode = decoded - started, encoded - decoded
        self._metrics.vae_decode_seconds.observe(timings.vae_decode)
        self._metrics.encode_seconds.observe(timings.encode)
        self._metrics.images.labels(params.output_format).inc()
        self._metrics.image_pixels.observe(image.width * image.height)
        item.emit(
            ImageFrame(
                request_id=job.request_id,
                image_index=0,
                seed=params.seed,
                width=image.width,
                height=image.height,
                output_format=params.output_format,
                data=data,
            )
        )

    def _inputs(self, conditionings: list[Conditioning], guidance_scale: float) -> dict[str, Any]:
        device = self._model.facts.device
        embeds, mask = _padded([(c.prompt_embeds, c.prompt_embeds_mask) for c in conditionings])
        inputs: dict[str, Any] = {
            "prompt_embeds": embeds.to(device),
            "prompt_embeds_mask": mask.to(device),
            "true_cfg_scale": 1.0,
            "max_sequence_length": embeds.shape[1],
        }
        if guidance_scale > 1.0:
            negatives = [(c.negative_prompt_embeds, c.negative_prompt_embeds_mask) for c in conditionings]
            if any(e is None or m is None for e, m in negatives):
                raise ValueError("CFG needs every job's negative conditioning")
            negative, negative_mask = _padded(negatives)  # type: ignore[arg-type]
            inputs |= {
                "negative_prompt_embeds": negative.to(device),
                "negative_prompt_embeds_mask": negative_mask.to(device),
                "true_cfg_scale": guidance_scale,
                "max_sequence_length": max(embeds.shape[1], negative.shape[1]),
            }
        return inputs


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
