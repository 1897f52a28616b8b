"""FastAPI routes of the public API: authentication, the generation call, cancellation, SSE.

A client that disconnects cancels its request, which aborts the engine runs and the DiT render.
In streaming mode the response is an event stream: partial images as they come, one completed
event per image; a failure after the stream started arrives as an error event.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from ar_service.admission import RequestAdmission
from ar_service.api.protocol import (
    CompletedEvent,
    ImageGenerationRequest,
    ModelCard,
    ModelList,
    PartialImageEvent,
)
from ar_service.api.serving import ImageServing
from ar_service.image_generation import GenerationRequest, GenerationResult
from services.auth import BearerAuth
from services.errors import ApiError
from shared.result_frames import PartialImageFrame

T = TypeVar("T")


def build_router(serving: ImageServing, admission: RequestAdmission, api_keys: BearerAuth) -> APIRouter:
    def check_api_key(request: Request) -> None:
        if api_keys.enabled:
            api_keys.check(request.headers.get("authorization"))

    router = APIRouter(dependencies=[Depends(check_api_key)])

    @router.get("/v1/models")
    async def list_models() -> ModelList:
        return await serving.models()

    @router.get("/v1/models/{model_id}")
    async def get_model(model_id: str) -> ModelCard:
        return await serving.model_card(model_id)

    @router.get("/v1/images/{name}")
    async def get_image(name: str) -> Response:
        image = serving.store.get(name)
        if image is None:
            raise ApiError(404, "image not found or expired", code="not_found", param="name")
        return Response(image.data, media_type=image.media_type, headers={"cache-control": "private, max-age=60"})

    @router.post("/v1/images/generations")
    async def generate(body: ImageGenerationRequest, request: Request) -> Response:
        received_at = time.perf_counter()
        gen = await serving.prepare(body, request.state.request_id, received_at)
        if body.stream:
            events = stream_events(serving, admission, body, gen)
            return StreamingResponse(events, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        with serving.observed(received_at):
            async with admission.slot():
                result = await cancel_on_disconnect(request, serving.generate(gen))
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
    serving: ImageServing, admission: RequestAdmission, body: ImageGenerationRequest, gen: GenerationRequest
) -> AsyncIterator[bytes]:
    """SSE: partial images as they come, then one completed event per image; errors as data."""
    partials: asyncio.Queue[PartialImageFrame] = asyncio.Queue()
    try:
        with serving.observed(gen.received_at):
            async with admission.slot():
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
        yield f"data: {json.dumps(exc.body())}\n\n".encode()


def server_timing(timings: dict[str, float]) -> str:
    """W3C Server-Timing: per-stage durations in milliseconds, readable by browsers and tools."""
    return ", ".join(f"{name};dur={seconds * 1000:.2f}" for name, seconds in timings.items())


def sse(event: PartialImageEvent | CompletedEvent) -> bytes:
    data = json.dumps(_json(event), separators=(",", ":"))
    return f"event: {event.type}\ndata: {data}\n\n".encode()


def _json(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", exclude_none=True)
