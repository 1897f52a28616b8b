"""The public API: OpenAI's ``POST /v1/images/generations`` and ``/v1/models``.

Request fields follow OpenAI's Images API; ardit's extras (``seed``, ``num_inference_steps``,
``guidance_scale``, ``negative_prompt``, ``max_new_tokens``, ``cache_salt``) come in the same body,
as the official client's ``extra_body`` sends them. Unknown fields are a 400 naming the field, as
OpenAI answers. ``usage`` carries OpenAI's fields plus two documented extensions,
``cached_tokens`` and ``cache_creation_tokens`` (vLLM's prefix-cache counts for this request).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ar_service.admission import RequestAdmission
from ar_service.handoff_client import DitRejected, DitUnavailable
from ar_service.image_generation import GenerationRequest, GenerationResult, ImageGenerator, PromptTooLong
from ar_service.image_store import ImageStore
from ar_service.metrics import ArMetrics
from ar_service.row_channel import RowStreamOverflow
from ar_service.settings import ArSettings
from services.app import ReadinessProbe
from services.errors import ApiError
from shared.frames import DiffusionParams
from shared.result_frames import PartialImageFrame

log = logging.getLogger("ardit.ar.api")

Quality = Literal["auto", "low", "medium", "high", "xhigh", "max", "standard", "hd"]
# Denoising steps when the request does not say: quality is the knob OpenAI clients have.
STEPS_BY_QUALITY = {"low": 4, "medium": 8, "auto": 8, "standard": 8, "high": 20, "hd": 20, "xhigh": 30, "max": 50}
SIZE_MULTIPLE = 16  # Qwen-Image: VAE factor 8 x patch 2


class ImageGenerationBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: Annotated[str, Field(min_length=1, max_length=32000)]
    model: str | None = None
    n: Annotated[int, Field(ge=1, le=10)] = 1
    size: str = "auto"
    quality: Quality = "auto"
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: Annotated[int, Field(ge=0, le=100)] | None = None
    background: Literal["auto", "opaque", "transparent"] = "auto"
    moderation: Literal["auto", "low"] | None = None
    style: Literal["vivid", "natural"] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    stream: bool = False
    partial_images: Annotated[int, Field(ge=0, le=3)] = 0
    # ardit extensions
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    # Qwen-Image's schedule needs at least 2 steps (1 step gives NaN sigmas).
    num_inference_steps: Annotated[int, Field(ge=2, le=100)] | None = None
    guidance_scale: Annotated[float, Field(ge=0.0, le=50.0)] | None = None
    negative_prompt: Annotated[str, Field(max_length=32000)] | None = None
    max_new_tokens: Annotated[int, Field(ge=1)] | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None

    @field_validator("size")
    @classmethod
    def _size_shape(cls, value: str) -> str:
        if value != "auto":
            width, sep, height = value.partition("x")
            if not (sep and width.isdigit() and height.isdigit()):
                raise ValueError("size must be 'auto' or WIDTHxHEIGHT, e.g. 256x256")
        return value


class ImageApi:
    def __init__(
        self,
        settings: ArSettings,
        generator: ImageGenerator,
        admission: RequestAdmission,
        store: ImageStore,
        metrics: ArMetrics,
        readiness: ReadinessProbe,
    ) -> None:
        self.readiness = readiness
        self.settings = settings
        self.generator = generator
        self.generator_slot = admission.slot
        self.store = store
        self.metrics = metrics

    def check_api_key(self, request: Request) -> None:
        if not self.settings.api_keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise ApiError(401, "missing API key: send Authorization: Bearer <key>", code="missing_api_key")
        if not any(secrets.compare_digest(key, known) for known in self.settings.api_keys):
            raise ApiError(401, "incorrect API key provided", code="invalid_api_key")

    async def check_ready(self) -> None:
        ready, reason = await self.readiness()
        if not ready:
            raise ApiError(503, f"service not ready: {reason}", code="not_ready", headers={"Retry-After": "5"})

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.served_model_name:
            raise ApiError(404, f"the model '{model}' does not exist", param="model", code="model_not_found")

    def to_generation_request(self, body: ImageGenerationBody, request_id: str, received_at: float) -> GenerationRequest:
        s = self.settings
        if body.background == "transparent":
            raise ApiError(400, "background 'transparent' is not supported by this model", param="background",
                           code="unsupported_value")
        if body.output_compression is not None and body.output_format == "png":
            raise ApiError(400, "output_compression applies to jpeg and webp only", param="output_compression",
                           code="invalid_value")
        width, height = self.size_of(body.size)
        max_new = body.max_new_tokens or s.max_new_tokens
        if max_new > s.max_new_tokens_limit:
            raise ApiError(400, f"max_new_tokens is limited to {s.max_new_tokens_limit}", param="max_new_tokens",
                           code="invalid_value")
        guidance = body.guidance_scale if body.guidance_scale is not None else s.default_guidance_scale
        use_cfg = guidance > 1.0 or body.negative_prompt is not None
        steps = body.num_inference_steps or STEPS_BY_QUALITY[body.quality]
        diffusion = DiffusionParams(
            width=width,
            height=height,
            num_inference_steps=steps,
            guidance_scale=float(guidance),
            seed=body.seed if body.seed is not None else int.from_bytes(request_id.encode()[-6:], "big") % (2**31),
            num_images=body.n,
            output_format=body.output_format,
            output_compression=body.output_compression,
            partial_images=body.partial_images if body.stream else 0,
        )
        return GenerationRequest(
            request_id=request_id,
            prompt=body.prompt,
            diffusion=diffusion,
            negative_prompt=(body.negative_prompt if body.negative_prompt is not None else s.default_negative_prompt)
            if use_cfg
            else None,
            max_new_tokens=max_new,
            cache_salt=body.cache_salt,
            received_at=received_at,
        )

    def size_of(self, size: str) -> tuple[int, int]:
        s = self.settings
        width, _, height = (s.default_size if size == "auto" else size).partition("x")
        w, h = int(width), int(height)
        if w < SIZE_MULTIPLE or h < SIZE_MULTIPLE or w % SIZE_MULTIPLE or h % SIZE_MULTIPLE:
            raise ApiError(400, f"size {size}: width and height must be positive multiples of {SIZE_MULTIPLE}",
                           param="size", code="invalid_size")
        if w * h > s.max_pixels:
            raise ApiError(400, f"size {size} is over the {s.max_pixels}-pixel limit", param="size", code="invalid_size")
        return w, h

    async def run(self, gen: GenerationRequest, partial_sink=None) -> GenerationResult:
        try:
            result = await self.generator.generate(gen, partial_sink)
            u = result.usage
            log.info("served %d image(s): %d prompt tokens (%d cached), %d generated, %.2fs", len(result.images),
                     u.prompt_tokens, u.cached_tokens, u.generated_tokens, time.perf_counter() - gen.received_at)
            return result
        except PromptTooLong as exc:
            raise ApiError(400, str(exc), param="prompt", code="context_length_exceeded") from None
        except DitRejected as exc:
            self.metrics.handoff_failures.labels(reason=exc.code or "rejected").inc()
            param = {"diffusion.width": "size", "diffusion.height": "size"}.get(exc.param or "", exc.param)
            raise ApiError(400 if exc.status < 500 else 502, f"the image model refused the request: {exc}",
                           param=param, code=exc.code) from None
        except DitUnavailable as exc:
            self.metrics.handoff_failures.labels(reason="dit_unavailable").inc()
            headers = {"Retry-After": exc.retry_after or "1"}
            raise ApiError(503, f"the image model is unavailable: {exc}", code="dit_unavailable", headers=headers) from None
        except RowStreamOverflow as exc:
            self.metrics.handoff_failures.labels(reason="row_buffer_overflow").inc()
            raise ApiError(503, str(exc), code="handoff_backpressure", headers={"Retry-After": "1"}) from None

    def response_body(self, body: ImageGenerationBody, result: GenerationResult, base_url: str) -> dict:
        data = []
        for image in sorted(result.images, key=lambda i: i.image_index):
            item: dict = {}
            if body.response_format == "url":
                name = self.store.put(image.data, image.output_format)
                item["url"] = f"{(self.settings.public_base_url or base_url).rstrip('/')}/v1/images/{name}"
            else:
                item["b64_json"] = base64.b64encode(image.data).decode()
            if result.revised_prompt is not None:
                item["revised_prompt"] = result.revised_prompt
            data.append(item)
        first = result.images[0] if result.images else None
        return {
            "created": int(time.time()),
            "data": data,
            "background": "opaque",
            "output_format": body.output_format,
            "size": f"{first.width}x{first.height}" if first else body.size,
            "quality": body.quality if body.quality in ("low", "medium", "high", "xhigh", "max") else None,
            "usage": usage_body(result),
        }


def usage_body(result: GenerationResult) -> dict:
    u = result.usage
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"text_tokens": u.prompt_tokens, "image_tokens": 0},
        "output_tokens": u.generated_tokens,
        "output_tokens_details": {"text_tokens": u.generated_tokens, "image_tokens": 0},
        "total_tokens": u.prompt_tokens + u.generated_tokens,
        # ardit extensions: vLLM's prefix-cache counts for this request (all streams).
        "cached_tokens": u.cached_tokens,
        "cache_creation_tokens": u.cache_creation_tokens,
    }


def server_timing(timings: dict[str, float]) -> str:
    """W3C Server-Timing: per-stage durations in milliseconds, readable by browsers and tools."""
    return ", ".join(f"{name};dur={seconds * 1000:.2f}" for name, seconds in timings.items())


def sse(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


def build_router(api: ImageApi) -> APIRouter:
    router = APIRouter(dependencies=[Depends(api.check_api_key)])

    @router.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_object(api.settings)]}

    @router.get("/v1/models/{model_id}")
    async def get_model(model_id: str) -> dict:
        api.check_model(model_id)
        return model_object(api.settings)

    @router.get("/v1/images/{name}")
    async def get_image(name: str) -> Response:
        image = api.store.get(name)
        if image is None:
            raise ApiError(404, "image not found or expired", code="not_found", param="name")
        return Response(image.data, media_type=image.media_type, headers={"cache-control": "private, max-age=60"})

    @router.post("/v1/images/generations")
    async def generate(body: ImageGenerationBody, request: Request) -> Response:
        received_at = time.perf_counter()
        api.check_model(body.model)
        await api.check_ready()
        request_id = request.state.request_id
        gen = api.to_generation_request(body, request_id, received_at)
        if body.stream:
            return StreamingResponse(stream_events(api, body, gen), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})
        status = "error"
        try:
            async with api.generator_slot():
                result = await cancel_on_disconnect(request, api.run(gen))
            status = "ok"
        finally:
            api.metrics.requests.labels(status=status).inc()
            api.metrics.request_seconds.observe(time.perf_counter() - received_at)
        return JSONResponse(api.response_body(body, result, str(request.base_url)),
                            headers={"server-timing": server_timing(result.timings)})

    return router


async def cancel_on_disconnect(request: Request, work) -> GenerationResult:
    """Run ``work``; if the client goes away first, cancel it (aborting engine and DiT work)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while not task.done():
            message = await request.receive()
            if message["type"] == "http.disconnect":
                task.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done():
            raise ApiError(499, "client closed the request", code="client_closed_request") from None
        raise
    finally:
        watcher.cancel()


async def stream_events(api: ImageApi, body: ImageGenerationBody, gen: GenerationRequest) -> AsyncIterator[bytes]:
    """SSE: partial images as they come, then one completed event per image; errors as data."""
    partials: asyncio.Queue = asyncio.Queue()

    async def on_partial(frame: PartialImageFrame) -> None:
        await partials.put(frame)

    status = "error"
    size = f"{gen.diffusion.width}x{gen.diffusion.height}"
    common = {"background": "opaque", "output_format": body.output_format, "quality": body.quality
              if body.quality in ("low", "medium", "high", "xhigh", "max") else "auto", "size": size}
    try:
        async with api.generator_slot():
            task = asyncio.ensure_future(api.run(gen, on_partial))
            try:
                while not task.done() or not partials.empty():
                    getter = asyncio.ensure_future(partials.get())
                    done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                    if getter in done:
                        frame = getter.result()
                        yield sse({"type": "image_generation.partial_image", "created_at": int(time.time()),
                                   "b64_json": base64.b64encode(frame.data).decode(),
                                   "partial_image_index": frame.partial_image_index, **common})
                    else:
                        getter.cancel()
                result = task.result()
            finally:
                task.cancel()
        for image in sorted(result.images, key=lambda i: i.image_index):
            yield sse({"type": "image_generation.completed", "created_at": int(time.time()),
                       "b64_json": base64.b64encode(image.data).decode(), "usage": usage_body(result), **common})
        status = "ok"
    except ApiError as exc:
        yield f"data: {json.dumps(exc.body())}\n\n".encode()
    finally:
        api.metrics.requests.labels(status=status).inc()
        api.metrics.request_seconds.observe(time.perf_counter() - gen.received_at)


def model_object(settings: ArSettings) -> dict:
    return {"id": settings.served_model_name, "object": "model", "created": 0, "owned_by": "ardit"}

