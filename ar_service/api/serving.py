"""Serving the public API: a validated request becomes a generation, its result a response.

Requests are validated for shape by ``protocol`` (and ``edit_form``), here against what the DiT
announced it can render (``DitCapabilities``), and an edit's uploads are decoded (``input_images``),
all before any engine work. Failures from below are turned into OpenAI-shaped errors by one table
(``FAILURES``), in the style of httpx's ``map_exceptions``.

An edit edits one image: Qwen-Image's img2img and inpaint pipelines start from one image, and the
text model has no image encoder through which reference images could condition it, so ``image[]``
with more than one file is refused rather than silently reduced to its first.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ar_service.api.edit_form import EditForm
from ar_service.api.protocol import (
    CompletedEvent,
    EventPrefix,
    ImageData,
    ImageEditRequest,
    ImageRequest,
    ImagesResponse,
    InputTokensDetails,
    ModelCard,
    ModelList,
    OutputTokensDetails,
    PartialImageEvent,
    RenderedPrompt,
    RenderRequest,
    Usage,
)
from ar_service.engine.hidden_state_engine import EngineUnavailable
from ar_service.engine.row_channel import RowQueueOverflow
from ar_service.handoff_client import DitBusy, DitRejected, DitUnavailable, PartialImageSink
from ar_service.image_generation import EditInput, GenerationRequest, GenerationResult, ImageGenerator, PromptTooLong
from ar_service.image_store import ImageStore, ImageTooLargeForStore
from ar_service.input_images import OutputSize, decode_edit
from ar_service.metrics import ArMetrics
from ar_service.readiness import NOT_READY_RETRY_AFTER, ArReadiness
from ar_service.settings import ArSettings
from services.errors import ApiError, Overloaded
from shared.capabilities import DitCapabilities
from shared.frames import MAX_SEED, DiffusionParams, EditSpec
from shared.result_frames import ImageFrame, PartialImageFrame

log = logging.getLogger("ardit.ar.serving")

# Denoising steps by quality when the request names no steps; "auto" (and "standard") take the
# DiT's announced default. Quality is the knob OpenAI clients have.
STEPS_BY_QUALITY = {"low": 4, "medium": 8, "high": 20, "hd": 20, "xhigh": 30, "max": 50}
# An edit's strength when the request names none, by input_fidelity (default "low"): diffusers'
# own img2img default, and less of the schedule re-run where the input should be kept closely.
STRENGTH_BY_FIDELITY = {"low": 0.6, "high": 0.3}
# DiT rejections that are about the request's parameters (a 400 naming them); any other
# rejection means the pair disagrees about the handoff itself, which is the server's fault.
_REQUEST_FAULTS = {"invalid_diffusion_params", "prompt_too_long", "empty_conditioning"}


def _dit_rejected(exc: DitRejected) -> ApiError:
    if exc.code in _REQUEST_FAULTS:
        return ApiError(400, f"the image model refused the request: {exc}", param=exc.param, code=exc.code)
    return ApiError(502, f"the image model refused the handoff: {exc}", code=exc.code)


def _dit_busy(exc: DitBusy) -> ApiError:
    return Overloaded(f"the image model is busy: {exc}", code="dit_busy", retry_after=float(exc.retry_after or 1))


def _dit_unavailable(exc: DitUnavailable) -> ApiError:
    return ApiError(
        503,
        f"the image model is unavailable: {exc}",
        code="dit_unavailable",
        headers={"Retry-After": exc.retry_after or "1"},
    )


def _engine_unavailable(exc: EngineUnavailable) -> ApiError:
    return ApiError(
        503,
        f"the text model is unavailable: {exc}",
        code="engine_unavailable",
        headers={"Retry-After": NOT_READY_RETRY_AFTER},
    )


# Every failure below the public API and the OpenAI-shaped error it becomes; first match wins.
FAILURES: list[tuple[type[Exception], Callable[[Any], ApiError]]] = [
    (EngineUnavailable, _engine_unavailable),
    (PromptTooLong, lambda exc: ApiError(400, str(exc), param=exc.param, code="context_length_exceeded")),
    (DitRejected, _dit_rejected),
    (DitBusy, _dit_busy),
    (DitUnavailable, _dit_unavailable),
    (RowQueueOverflow, lambda exc: ApiError(503, str(exc), code="handoff_backpressure", headers={"Retry-After": "1"})),
]


@contextmanager
def map_failures() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        for kind, to_error in FAILURES:
            if isinstance(exc, kind):
                raise to_error(exc) from None
        raise


class ImageServing:
    def __init__(
        self,
        settings: ArSettings,
        generator: ImageGenerator,
        store: ImageStore,
        metrics: ArMetrics,
        readiness: ArReadiness,
    ) -> None:
        self.settings = settings
        self.generator = generator
        self.store = store
        self.metrics = metrics
        self.readiness = readiness

    async def models(self) -> ModelList:
        return ModelList(data=[await self.model_card()])

    async def model_card(self, model_id: str | None = None) -> ModelCard:
        self.check_model(model_id)
        capabilities = (await self.readiness.dits.state()).capabilities
        return ModelCard(
            id=self.settings.served_model_name, description=capabilities.description if capabilities else None
        )

    def render(self, body: RenderRequest, request_id: str) -> list[RenderedPrompt]:
        """The templated prompt's token ids, as vLLM's /v1/completions/render gives them."""
        self.check_model(body.model)
        return [RenderedPrompt(request_id=request_id, token_ids=self.generator.prompt_token_ids(body.prompt))]

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.served_model_name:
            raise ApiError(404, f"the model '{model}' does not exist", param="model", code="model_not_found")

    async def prepare(self, body: ImageRequest, request_id: str, received_at: float) -> tuple[GenerationRequest, int]:
        """Everything that can refuse a request before it queues: model, readiness, parameters.

        Returns the generation and the pair's capacity (requests the DiT holds at once).
        """
        self.check_model(body.model)
        capabilities, capacity = await self.readiness.require()
        return self.to_generation(body, request_id, received_at, capabilities), capacity

    async def prepare_edit(self, form: EditForm, request_id: str, received_at: float) -> tuple[GenerationRequest, int]:
        """``prepare`` for an edit: also decodes the uploads (in a worker thread), before it queues."""
        body = form.request
        self.check_model(body.model)
        if len(form.images) > 1:
            raise _invalid(
                f"{len(form.images)} images were sent; this model edits one image (it has no image encoder "
                "that reference images could condition), so image[] may hold one file",
                "image",
                "unsupported_value",
            )
        capabilities, capacity = await self.readiness.require()
        limits = capabilities.limits
        requested = (
            None if body.size == "auto" else self._checked_size(body.size, limits.size_multiple, limits.max_pixels)
        )
        pixels = await asyncio.to_thread(
            decode_edit,
            form.images[0].data,
            form.mask.data if form.mask is not None else None,
            OutputSize(requested, limits.size_multiple, limits.max_pixels),
            self.settings.max_edit_input_pixels,
        )
        edit = EditInput(EditSpec(strength=edit_strength(body), mask=pixels.mask is not None), pixels)
        gen = self.to_generation(body, request_id, received_at, capabilities, edit)
        return gen, capacity

    def to_generation(
        self,
        body: ImageRequest,
        request_id: str,
        received_at: float,
        dit: DitCapabilities,
        edit: EditInput | None = None,
    ) -> GenerationRequest:
        """The public request as the AR and DiT run it, checked against the DiT's announced limits.

        ``edit``: an edit's decoded image, already at the output size, and its strength.
        """
        s, limits, defaults = self.settings, dit.limits, dit.defaults
        if body.background == "transparent":
            raise _invalid("background 'transparent' is not supported by this model", "background", "unsupported_value")
        if body.output_format not in limits.output_formats:
            raise _invalid(
                f"output_format {body.output_format!r} is not supported here", "output_format", "unsupported_value"
            )
        if body.output_compression is not None and body.output_format == "png":
            raise _invalid("output_compression applies to jpeg and webp only", "output_compression")
        if edit is not None:
            width, height = edit.pixels.width, edit.pixels.height
        elif body.size == "auto":
            width, height = defaults.width, defaults.height
        else:
            width, height = self._checked_size(body.size, limits.size_multiple, limits.max_pixels)
        if body.n > limits.max_images:
            raise _invalid(f"n is limited to {limits.max_images}", "n")
        steps = body.num_inference_steps or STEPS_BY_QUALITY.get(body.quality, defaults.num_inference_steps)
        if not limits.min_inference_steps <= steps <= limits.max_inference_steps:
            raise _invalid(
                f"num_inference_steps must be within [{limits.min_inference_steps}, {limits.max_inference_steps}]",
                "num_inference_steps",
            )
        guidance = body.guidance_scale if body.guidance_scale is not None else defaults.guidance_scale
        if guidance > limits.max_guidance_scale:
            raise _invalid(f"guidance_scale is limited to {limits.max_guidance_scale}", "guidance_scale")
        max_new = body.max_new_tokens or s.max_new_tokens
        if max_new > s.max_new_tokens_limit:
            raise _invalid(f"max_new_tokens is limited to {s.max_new_tokens_limit}", "max_new_tokens")
        # A request without a seed gets one derived from its id: reproducible from the logs.
        seed = body.seed if body.seed is not None else int.from_bytes(request_id.encode()[-6:], "big") % (2**31)
        if seed + body.n - 1 > MAX_SEED:
            raise _invalid("seed + n - 1 is over the largest seed", "seed")
        use_cfg = guidance > 1.0 or body.negative_prompt is not None
        return GenerationRequest(
            request_id=request_id,
            prompt=body.prompt,
            diffusion=DiffusionParams(
                width=width,
                height=height,
                num_inference_steps=steps,
                guidance_scale=float(guidance),
                seed=seed,
                num_images=body.n,
                output_format=body.output_format,
                output_compression=body.output_compression,
                partial_images=body.partial_images if body.stream else 0,
            ),
            edit=edit,
            max_conditioning_rows=limits.max_conditioning_rows,
            negative_prompt=(body.negative_prompt if body.negative_prompt is not None else s.default_negative_prompt)
            if use_cfg
            else None,
            max_new_tokens=max_new,
            cache_salt=body.cache_salt,
            received_at=received_at,
        )

    @staticmethod
    def _checked_size(size: str, multiple: int, max_pixels: int) -> tuple[int, int]:
        width, height = _size(size)
        if width < multiple or height < multiple or width % multiple or height % multiple:
            raise _invalid(
                f"size {size}: width and height must be positive multiples of {multiple}", "size", "invalid_size"
            )
        if width * height > max_pixels:
            raise _invalid(f"size {size} is over the {max_pixels}-pixel limit", "size", "invalid_size")
        return width, height

    async def generate(
        self, gen: GenerationRequest, on_partial_image: PartialImageSink | None = None
    ) -> GenerationResult:
        with map_failures():
            try:
                result = await self.generator.generate(gen, on_partial_image)
            except DitUnavailable:
                self.readiness.dits.forget()  # the next request probes the DiTs again
                raise
        u = result.usage
        log.info(
            "served %d image(s): %d prompt tokens (%d cached), %d generated, %.2fs",
            len(result.images),
            u.prompt_tokens,
            u.cached_tokens,
            u.generated_tokens,
            time.perf_counter() - gen.received_at,
        )
        return result

    @contextmanager
    def observed(self, received_at: float) -> Iterator[None]:
        """Counts one image request by outcome and times it, for the JSON and the SSE path alike."""
        status = "error"
        try:
            yield
            status = "ok"
        finally:
            self.metrics.requests.labels(status=status).inc()
            self.metrics.request_seconds.observe(time.perf_counter() - received_at)

    def response(
        self, body: ImageRequest, gen: GenerationRequest, result: GenerationResult, base_url: str
    ) -> ImagesResponse:
        data = []
        for image in _in_order(result.images):
            if body.response_format == "url":
                item = ImageData(url=self._stored(image, base_url))
            else:
                item = ImageData(b64_json=_b64(image.data))
            data.append(item.model_copy(update={"revised_prompt": result.revised_prompt}))
        first = result.images[0]
        return ImagesResponse(
            created=int(time.time()),
            data=data,
            output_format=gen.diffusion.output_format,
            size=f"{first.width}x{first.height}",
            quality=body.echoed_quality,
            safety_identifier=body.effective_safety_identifier,
            usage=usage(result),
        )

    def _stored(self, image: ImageFrame, base_url: str) -> str:
        try:
            name = self.store.put(image.data, image.output_format)
        except ImageTooLargeForStore as exc:
            raise _invalid(f"{exc}; ask for response_format=b64_json", "response_format", "unsupported_value") from None
        return f"{(self.settings.public_base_url or base_url).rstrip('/')}/v1/images/{name}"

    @staticmethod
    def partial_event(
        prefix: EventPrefix, body: ImageRequest, gen: GenerationRequest, frame: PartialImageFrame
    ) -> PartialImageEvent:
        return PartialImageEvent(
            type=f"{prefix}.partial_image",
            b64_json=_b64(frame.data),
            created_at=int(time.time()),
            partial_image_index=frame.partial_image_index,
            output_format=gen.diffusion.output_format,
            quality=body.echoed_quality or "auto",
            size=_size_of(gen),
        )

    @staticmethod
    def completed_events(
        prefix: EventPrefix, body: ImageRequest, gen: GenerationRequest, result: GenerationResult
    ) -> list[CompletedEvent]:
        return [
            CompletedEvent(
                type=f"{prefix}.completed",
                b64_json=_b64(image.data),
                created_at=int(time.time()),
                output_format=gen.diffusion.output_format,
                quality=body.echoed_quality or "auto",
                size=_size_of(gen),
                safety_identifier=body.effective_safety_identifier,
                usage=usage(result),
            )
            for image in _in_order(result.images)
        ]


def edit_strength(body: ImageEditRequest) -> float:
    """``strength`` as given, else the one ``input_fidelity`` implies."""
    return float(body.strength if body.strength is not None else STRENGTH_BY_FIDELITY[body.input_fidelity or "low"])


def usage(result: GenerationResult) -> Usage:
    u = result.usage
    return Usage(
        input_tokens=u.prompt_tokens,
        input_tokens_details=InputTokensDetails(text_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens),
        output_tokens=u.generated_tokens,
        output_tokens_details=OutputTokensDetails(text_tokens=u.generated_tokens),
        total_tokens=u.prompt_tokens + u.generated_tokens,
        cached_tokens=u.cached_tokens,
        cache_creation_tokens=u.cache_creation_tokens,
    )


def _invalid(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _size(size: str) -> tuple[int, int]:
    width, _, height = size.partition("x")
    return int(width), int(height)


def _size_of(gen: GenerationRequest) -> str:
    return f"{gen.diffusion.width}x{gen.diffusion.height}"


def _in_order(images: list[ImageFrame]) -> list[ImageFrame]:
    return sorted(images, key=lambda i: i.image_index)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
