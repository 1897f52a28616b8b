"""FastAPI routes of the public API: generations, edits, served images, models; cancellation, SSE.

A client that disconnects cancels its request, which aborts the engine runs and the DiT render.
Refusals known before any work (404, 503, 400, 429) are HTTP statuses in both modes, so clients
raise and retry them; in streaming mode the response is then an event stream (sse-starlette, with
keep-alive comments so a proxy does not cut a long, silent render): partial images as they come,
one completed event per image, and an ``error`` event for a failure after the stream started.
Generations and edits differ only in how the request arrives (JSON, or a multipart form with the
image) and in their event names (``image_generation.*``, ``image_edit.*``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.background import BackgroundTask

from ar_service.admission import AdmissionTicket, RequestAdmission
from ar_service.api.edit_form import read_edit_form
from ar_service.api.protocol import (
    CompletedEvent,
    EventPrefix,
    ImageEditRequest,
    ImageGenerationRequest,
    ImageRequest,
    ImagesResponse,
    ModelCard,
    ModelList,
    PartialImageEvent,
    RenderedPrompt,
    RenderRequest,
)
from ar_service.api.serving import ImageServing
from ar_service.image_generation import GenerationRequest, GenerationResult
from services.errors import ApiError, error_responses
from shared.result_frames import PartialImageFrame

T = TypeVar("T")

# Every route is behind the RequestGate: a missing key, a too-large or too-slow body.
_GATE = (401, 408, 413)
_IMAGE_TYPES = {
    t: {"schema": {"type": "string", "format": "binary"}} for t in ("image/png", "image/jpeg", "image/webp")
}
_GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "model": ImagesResponse,
        "description": "The images (JSON), or with stream=true an event stream of partial and completed images.",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
    **error_responses(400, *_GATE, 404, 429, 503),
}


def _edit_form_schema() -> dict[str, Any]:
    """The multipart body as the official client sends it: the request's fields as text parts, the
    files as file parts. (``svg``'s bracketed parts, ``svg[model]``, are accepted but not listed.)"""
    fields = ImageEditRequest.model_json_schema(ref_template="#/components/schemas/{model}")["properties"]
    fields.pop("svg")
    binary = {"type": "string", "format": "binary"}
    files = {
        "image": {**binary, "description": "The image to edit (PNG, JPEG or WebP); or send it as image[]."},
        "image[]": {"type": "array", "items": binary, "maxItems": 16, "description": "One image, as a list."},
        "mask": {**binary, "description": "PNG of the image's size; fully transparent pixels are repainted."},
    }
    return {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {"type": "object", "properties": {**fields, **files}, "required": ["prompt", "image"]}
            }
        },
    }


def build_router(serving: ImageServing, admission: RequestAdmission) -> APIRouter:
    """The routes; API keys, body size and body-read deadline are checked before them (RequestGate)."""
    router = APIRouter()

    @router.get("/v1/models", responses=error_responses(*_GATE))
    async def list_models() -> ModelList:
        return await serving.models()

    @router.get("/v1/models/{model_id}", responses=error_responses(*_GATE, 404))
    async def get_model(model_id: str) -> ModelCard:
        return await serving.model_card(model_id)

    @router.get(
        "/v1/images/{name}",
        response_class=Response,
        responses={200: {"content": _IMAGE_TYPES, "description": "The image file."}, **error_responses(*_GATE, 404)},
    )
    async def get_image(name: str) -> Response:
        image = serving.store.get(name)
        if image is None:
            raise ApiError(404, "image not found or expired", code="not_found", param="name")
        return Response(image.data, media_type=image.media_type, headers={"cache-control": "private, max-age=60"})

    @router.post("/v1/completions/render", responses=error_responses(*_GATE, 400, 404))
    async def render(body: RenderRequest, request: Request) -> list[RenderedPrompt]:
        """The token ids of an image request's templated prompt, as vLLM's own endpoint gives a
        completion's: a prefix-aware router hashes exactly what this AR will cache."""
        return serving.render(body, request.state.request_id)

    @router.post("/v1/images/generations", response_model=None, responses=_GENERATION_RESPONSES)
    async def generate(body: ImageGenerationRequest, request: Request) -> Response:
        received_at = time.perf_counter()
        gen, capacity = await serving.prepare(body, request.state.request_id, received_at)
        return await serve(request, "image_generation", body, gen, capacity)

    @router.post(
        "/v1/images/edits",
        response_model=None,
        responses=_GENERATION_RESPONSES,
        openapi_extra={"requestBody": _edit_form_schema()},
    )
    async def edit(request: Request) -> Response:
        received_at = time.perf_counter()
        form = await read_edit_form(request)
        gen, capacity = await serving.prepare_edit(form, request.state.request_id, received_at)
        return await serve(request, "image_edit", form.request, gen, capacity)

    @router.post("/v1/images/variations", responses=error_responses(*_GATE, 404))
    async def variations() -> Response:
        raise ApiError(
            404,
            "image variations are not served here: ardit renders from text (a variation needs an image encoder "
            "it does not have); use /v1/images/edits with a prompt",
            code="unsupported_endpoint",
        )

    async def serve(
        request: Request, prefix: EventPrefix, body: ImageRequest, gen: GenerationRequest, capacity: int
    ) -> Response:
        # Every refusal known before any work is an HTTP status, in stream mode too: 404 / 503 /
        # 400 (from prepare), then 429 from admission (after waiting in the queue, if there is room).
        ticket = await cancel_on_disconnect(request, admission.admit(capacity))
        if body.stream:
            events = stream_events(serving, ticket, prefix, body, gen)
            return EventSourceResponse(
                events, ping=serving.settings.sse_keepalive_seconds, sep="\n", background=BackgroundTask(ticket.release)
            )
        try:
            with serving.observed(gen.received_at):
                result = await cancel_on_disconnect(request, serving.generate(gen))
        finally:
            ticket.release()
        answer = serving.response(body, gen, result, str(request.base_url))
        return JSONResponse(_json(answer), headers={"server-timing": server_timing(result.timings)})

    return router


async def cancel_on_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
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


async def stream_events(
    serving: ImageServing, ticket: AdmissionTicket, prefix: EventPrefix, body: ImageRequest, gen: GenerationRequest
) -> AsyncIterator[ServerSentEvent]:
    """Partial images as they come, then one completed event per image; a failure after the
    stream started arrives as an ``error`` event (the status line is already sent)."""
    partials: asyncio.Queue[PartialImageFrame] = asyncio.Queue()
    try:
        with serving.observed(gen.received_at):
            task = asyncio.ensure_future(serving.generate(gen, partials.put))
            try:
                while not task.done() or not partials.empty():
                    getter = asyncio.ensure_future(partials.get())
                    done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                    if getter in done:
                        yield sse(serving.partial_event(prefix, body, gen, getter.result()))
                    else:
                        getter.cancel()
                result: GenerationResult = task.result()
            finally:
                task.cancel()
            for event in serving.completed_events(prefix, body, gen, result):
                yield sse(event)
    except ApiError as exc:
        serving.metrics.app.count_error(exc)
        yield ServerSentEvent(event="error", data=json.dumps(exc.body()))
    finally:
        ticket.release()


def server_timing(timings: dict[str, float]) -> str:
    """W3C Server-Timing: per-stage durations in milliseconds, readable by browsers and tools."""
    return ", ".join(f"{name};dur={seconds * 1000:.2f}" for name, seconds in timings.items())


def sse(event: PartialImageEvent | CompletedEvent) -> ServerSentEvent:
    return ServerSentEvent(event=event.type, data=json.dumps(_json(event), separators=(",", ":")))


def _json(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", exclude_none=True)
