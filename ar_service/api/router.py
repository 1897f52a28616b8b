"""The public API's routes: each makes one call into ``ImageServing`` and maps the result to HTTP.

API keys, body size and the body-read deadline are checked before any route (``RequestGate``);
how an image answer is written (JSON or an event stream) is ``http_answer``'s.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ar_service.api.edit_form import edit_form_openapi
from ar_service.api.http_answer import GATE_ERRORS, IMAGE_FILE_TYPES, IMAGES_RESPONSES, http_answer
from ar_service.api.protocol import ImageGenerationRequest, ModelList, ModelObject, RenderedPrompt, RenderRequest
from ar_service.api.serving import ImageServing
from services.errors import ApiError, error_responses

GENERATIONS = "/v1/images/generations"
EDITS = "/v1/images/edits"
# The routes that make images: admitted at arrival (``admission_door``).
IMAGE_ROUTES = (GENERATIONS, EDITS)
RENDER = "/v1/completions/render"  # a prefix-aware router's call (vLLM's name)


def build_router(serving: ImageServing, sse_keepalive_seconds: float) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models", responses=error_responses(*GATE_ERRORS))
    async def list_models() -> ModelList:
        return await serving.models()

    @router.get("/v1/models/{model_id}", responses=error_responses(*GATE_ERRORS, 404))
    async def get_model(model_id: str) -> ModelObject:
        return await serving.model(model_id)

    @router.get(
        "/v1/images/{name:image_name}",
        response_class=Response,
        responses={
            200: {"content": IMAGE_FILE_TYPES, "description": "The image file."},
            **error_responses(*GATE_ERRORS, 404),
        },
    )
    async def get_image(name: str) -> Response:
        image = await serving.stored_image(name)
        return Response(image.data, media_type=image.media_type, headers={"cache-control": "private, max-age=60"})

    @router.post(RENDER, responses=error_responses(*GATE_ERRORS, 400, 404))
    async def render(body: RenderRequest, request: Request) -> list[RenderedPrompt]:
        """The token ids of an image request's templated prompt, as vLLM's own endpoint gives a
        completion's: a prefix-aware router hashes exactly what this AR will cache."""
        return serving.rendered_prompt(body, request.state.request_id)

    @router.post(GENERATIONS, response_model=None, responses=IMAGES_RESPONSES)
    async def generate(body: ImageGenerationRequest, request: Request) -> Response:
        return http_answer(await serving.create_images(body, request), sse_keepalive_seconds)

    @router.post(
        EDITS,
        response_model=None,
        responses=IMAGES_RESPONSES,
        openapi_extra={"requestBody": edit_form_openapi()},
    )
    async def edit(request: Request) -> Response:
        return http_answer(await serving.create_edit(request), sse_keepalive_seconds)

    @router.post("/v1/images/variations", responses=error_responses(*GATE_ERRORS, 404))
    async def variations() -> Response:
        raise ApiError(
            404,
            "image variations are not served here: a variation is an edit without a prompt, which no model ardit "
            "serves takes; use /v1/images/edits with a prompt",
            code="unsupported_endpoint",
        )

    return router
