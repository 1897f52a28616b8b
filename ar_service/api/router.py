"""The public API's routes: each makes one call into ``ImageServing`` and maps the result to HTTP.

API keys, body size and the body-read deadline are checked before any route (``RequestGate``).
An image answer is JSON with a ``server-timing`` header, or, with ``stream: true``, an event
stream (sse-starlette, with keep-alive comments so a proxy does not cut a long, silent render).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, get_args

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent

from ar_service.api.edit_form import MAX_IMAGES
from ar_service.api.protocol import (
    EventPrefix,
    ImageEditRequest,
    ImageGenerationRequest,
    ImagesResponse,
    ModelList,
    ModelObject,
    RenderedPrompt,
    RenderRequest,
)
from ar_service.api.serving import ImageEvents, ImagesAnswer, ImageServing, StreamError
from services.errors import ApiError, error_responses

GENERATIONS = "/v1/images/generations"
EDITS = "/v1/images/edits"
# The routes that make images: admitted at arrival (``admission_door``).
IMAGE_ROUTES = (GENERATIONS, EDITS)
RENDER = "/v1/completions/render"  # a prefix-aware router's call (vLLM's name)
# Every route is behind the RequestGate: a missing key, a too-large or too-slow body.
_GATE = (401, 408, 413)
_IMAGE_TYPES = {
    t: {"schema": {"type": "string", "format": "binary"}} for t in ("image/png", "image/jpeg", "image/webp")
}
# One server-sent event (OpenAPI 3.0/3.1 describe a stream by the schema of each event): its name, and its data,
# the event's JSON (a PartialImageEvent, a CompletedEvent, or an OpenAI error body).
_EVENT_NAMES = [f"{prefix}.{kind}" for prefix in get_args(EventPrefix) for kind in ("partial_image", "completed")]
_SSE_EVENT = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {
        "event": {"type": "string", "enum": [*_EVENT_NAMES, "error"]},
        "data": {"type": "string", "contentMediaType": "application/json"},
    },
}
_IMAGES_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "model": ImagesResponse,
        "description": "The images (JSON), or with stream=true an event stream of partial and completed images.",
        "content": {"text/event-stream": {"schema": _SSE_EVENT}},
    },
    **error_responses(400, *_GATE, 404, 429, 503),
}


def build_router(serving: ImageServing, sse_keepalive_seconds: float) -> APIRouter:
    router = APIRouter()

    def answer(result: ImagesAnswer | ImageEvents) -> Response:
        if isinstance(result, ImagesAnswer):
            return JSONResponse(_json(result.body), headers={"server-timing": server_timing(result.timings)})
        return EventSourceResponse(_sse(result), ping=sse_keepalive_seconds, sep="\n")

    @router.get("/v1/models", responses=error_responses(*_GATE))
    async def list_models() -> ModelList:
        return await serving.models()

    @router.get("/v1/models/{model_id}", responses=error_responses(*_GATE, 404))
    async def get_model(model_id: str) -> ModelObject:
        return await serving.model(model_id)

    @router.get(
        "/v1/images/{name:image_name}",
        response_class=Response,
        responses={200: {"content": _IMAGE_TYPES, "description": "The image file."}, **error_responses(*_GATE, 404)},
    )
    async def get_image(name: str) -> Response:
        image = await serving.stored_image(name)
        return Response(image.data, media_type=image.media_type, headers={"cache-control": "private, max-age=60"})

    @router.post(RENDER, responses=error_responses(*_GATE, 400, 404))
    async def render(body: RenderRequest, request: Request) -> list[RenderedPrompt]:
        """The token ids of an image request's templated prompt, as vLLM's own endpoint gives a
        completion's: a prefix-aware router hashes exactly what this AR will cache."""
        return serving.rendered_prompt(body, request.state.request_id)

    @router.post(GENERATIONS, response_model=None, responses=_IMAGES_RESPONSES)
    async def generate(body: ImageGenerationRequest, request: Request) -> Response:
        return answer(await serving.create_images(body, request))

    @router.post(
        EDITS,
        response_model=None,
        responses=_IMAGES_RESPONSES,
        openapi_extra={"requestBody": _edit_form_schema()},
    )
    async def edit(request: Request) -> Response:
        return answer(await serving.create_edit(request))

    @router.post("/v1/images/variations", responses=error_responses(*_GATE, 404))
    async def variations() -> Response:
        raise ApiError(
            404,
            "image variations are not served here: ardit renders from text (a variation needs an image encoder "
            "it does not have); use /v1/images/edits with a prompt",
            code="unsupported_endpoint",
        )

    return router


def _edit_form_schema() -> dict[str, Any]:
    """The multipart body as the official client sends it: the request's fields as text parts, the
    files as file parts. (``svg``'s bracketed parts, ``svg[model]``, are accepted but not listed.)"""
    fields = ImageEditRequest.model_json_schema(ref_template="#/components/schemas/{model}")["properties"]
    fields.pop("svg")
    binary = {"type": "string", "format": "binary"}
    files = {
        "image": {**binary, "description": "The image to edit (PNG, JPEG or WebP); or send it as image[]."},
        "image[]": {"type": "array", "items": binary, "maxItems": MAX_IMAGES, "description": "One image, as a list."},
        "mask": {**binary, "description": "PNG of the image's size; fully transparent pixels are repainted."},
    }
    schema = {"type": "object", "properties": {**fields, **files}, "required": ["prompt", "image"]}
    return {"required": True, "content": {"multipart/form-data": {"schema": schema}}}


async def _sse(events: ImageEvents) -> AsyncIterator[ServerSentEvent]:
    async for event in events:
        if isinstance(event, StreamError):
            yield ServerSentEvent(event="error", data=json.dumps(event.error.body()))
        else:
            yield ServerSentEvent(event=event.type, data=json.dumps(_json(event), separators=(",", ":")))


def server_timing(timings: dict[str, float]) -> str:
    """W3C Server-Timing: per-stage durations in milliseconds, readable by browsers and tools."""
    return ", ".join(f"{name};dur={seconds * 1000:.2f}" for name, seconds in timings.items())


def _json(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", exclude_none=True)
