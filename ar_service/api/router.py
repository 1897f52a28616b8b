"""FastAPI routes of the public API: authentication, the generation call, cancellation, SSE.

A client that disconnects cancels its request, which aborts the engine runs and the DiT render.
Refusals known before any work (404, 503, 400, 429) are HTTP statuses in both modes, so clients
raise and retry them; in streaming mode the response is then an event stream (sse-starlette, with
keep-alive comments so a proxy does not cut a long, silent render): partial images as they come,
one completed event per image, and an ``error`` event for a failure after the stream started.
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
from ar_service.api.protocol import (
    CompletedEvent,
    ImageGenerationRequest,
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
        # Every refusal known before any work is an HTTP status, in stream mode too: 404 / 503 /
        # 400, then 429 from admission (after waiting in the queue, if there is room to wait).
        gen, capacity = await serving.prepare(body, request.state.request_id, received_at)
        ticket = await cancel_on_disconnect(request, admission.admit(capacity))
        if body.stream:
            events = stream_events(serving, ticket, body, gen)
            return EventSourceResponse(
                events, ping=serving.settings.sse_keepalive_seconds, sep="\n", background=BackgroundTask(ticket.release)
            )
        try:
            with serving.observed(received_at):
                result = await cancel_on_disconnect(request, serving.generate(gen))
        finally:
            ticket.release()
        answer = serving.response(body, result, str(request.base_url))
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
    serving: ImageServing, ticket: AdmissionTicket, body: ImageGenerationRequest, gen: GenerationRequest
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
                        yield sse(serving.partial_event(body, gen, getter.result()))
                    else:
                        getter.cancel()
                result: GenerationResult = task.result()
            finally:
                task.cancel()
            for event in serving.completed_events(body, gen, result):
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
