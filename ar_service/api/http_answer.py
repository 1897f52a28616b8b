"""How an image answer is written in HTTP, and how the OpenAPI document describes it.

An ``ImagesAnswer`` is JSON with a W3C ``server-timing`` header; ``ImageEvents`` is an event stream
(sse-starlette, with keep-alive comments so a proxy does not cut a long, silent render), each
event's data its JSON, and a failure after the status line an ``error`` event with OpenAI's body.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, get_args

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent

from ar_service.api.protocol import EventPrefix, ImagesResponse
from ar_service.api.serving import ImageEvents, ImagesAnswer, StreamError
from services.errors import error_responses

# Every route is behind the RequestGate: a missing key, a too-large or too-slow body.
GATE_ERRORS = (401, 408, 413)
IMAGE_FILE_TYPES = {
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
IMAGES_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "model": ImagesResponse,
        "description": "The images (JSON), or with stream=true an event stream of partial and completed images.",
        "content": {"text/event-stream": {"schema": _SSE_EVENT}},
    },
    **error_responses(400, *GATE_ERRORS, 404, 429, 503),
}


def http_answer(result: ImagesAnswer | ImageEvents, sse_keepalive_seconds: float) -> Response:
    if isinstance(result, ImagesAnswer):
        return JSONResponse(_json(result.body), headers={"server-timing": server_timing(result.timings)})
    return EventSourceResponse(_sse(result), ping=sse_keepalive_seconds, sep="\n")


def server_timing(timings: dict[str, float]) -> str:
    """W3C Server-Timing: per-stage durations in milliseconds, readable by browsers and tools."""
    return ", ".join(f"{name};dur={seconds * 1000:.2f}" for name, seconds in timings.items())


async def _sse(events: ImageEvents) -> AsyncIterator[ServerSentEvent]:
    async for event in events:
        if isinstance(event, StreamError):
            yield ServerSentEvent(event="error", data=json.dumps(event.error.body()))
        else:
            yield ServerSentEvent(event=event.type, data=json.dumps(_json(event), separators=(",", ":")))


def _json(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", exclude_none=True)
