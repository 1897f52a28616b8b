"""Serving the public API: one call owns an image request, from the body to the answer.

``ImageServing.create_images`` (and ``create_edit``) runs a request's hops in order, from the
admission place the request took at arrival (``admission_door``: a slot, a place in line, or 429
at once): the DiTs' readiness and announcement → ``validation`` (everything a request can be
refused for without a model, token counts included) → its turn in line → the generation
(``ImageGenerator``) → the answer: an ``ImagesAnswer`` (JSON), or an ``ImageEvents`` stream of
previews and completed images. The route only maps that to HTTP (vLLM's entrypoints shape).
Failures from below become OpenAI-shaped errors through one table (``FAILURES``), in the style of
httpx's ``map_exceptions``; in a stream, a failure after the status line is an ``error`` event.

A client that disconnects cancels its request, which aborts the engine runs and the DiT render.
The admission slot is given back when the generation is over, before the events are written.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from ar_service.admission import AdmissionPlace, AdmissionTicket, RequestAdmission
from ar_service.api.admission_door import take_place
from ar_service.api.edit_form import read_edit_form
from ar_service.api.protocol import (
    CompletedEvent,
    ImageData,
    ImageGenerationRequest,
    ImagesResponse,
    InputTokensDetails,
    ModelList,
    ModelObject,
    OutputTokensDetails,
    PartialImageEvent,
    RenderedPrompt,
    RenderRequest,
    Usage,
)
from ar_service.api.validation import RequestValidator, ValidGeneration
from ar_service.engine.hidden_state_engine import EngineUnavailable
from ar_service.engine.row_channel import RowQueueOverflow
from ar_service.handoff_client import DitBusy, DitRejected, DitUnavailable, PartialImageSink
from ar_service.image_generation import GenerationResult, ImageGenerator
from ar_service.image_store import ImageStore, ImageStoreUnavailable, ImageTooLargeForStore, StoredImage
from ar_service.metrics import ArMetrics
from ar_service.readiness import NOT_READY_RETRY_AFTER, ArReadiness
from ar_service.settings import ArSettings
from services.drain import Drain
from services.errors import ApiError, Overloaded
from shared.capabilities import Load
from shared.errors import EmptyConditioning, InvalidDiffusionParams, PromptTooLong
from shared.result_frames import ImageFrame, PartialImageFrame

log = logging.getLogger("ardit.ar.serving")

T = TypeVar("T")
# DiT rejections that are about the request's parameters (a 400 naming them); any other
# rejection means the pair disagrees about the handoff itself, which is the server's fault.
_REQUEST_FAULTS = {kind.code for kind in (InvalidDiffusionParams, PromptTooLong, EmptyConditioning)}


def _dit_rejected(exc: DitRejected) -> ApiError:
    if exc.code in _REQUEST_FAULTS:
        return ApiError(400, f"the image model refused the request: {exc}", param=exc.param, code=exc.code)
    return ApiError(502, f"the image model refused the handoff: {exc}", code=exc.code)


def _dit_busy(exc: DitBusy) -> ApiError:
    return Overloaded(f"the image model is busy: {exc}", code="dit_busy", retry_after=float(exc.retry_after or 1))


def _unavailable(message: str, code: str, retry_after: str) -> ApiError:
    return ApiError(503, message, code=code, headers={"Retry-After": retry_after})


# Every failure below the public API and the OpenAI-shaped error it becomes; first match wins.
FAILURES: list[tuple[type[Exception], Callable[[Any], ApiError]]] = [
    (
        EngineUnavailable,
        lambda exc: _unavailable(f"the text model is unavailable: {exc}", "engine_unavailable", NOT_READY_RETRY_AFTER),
    ),
    (DitRejected, _dit_rejected),
    (DitBusy, _dit_busy),
    (
        DitUnavailable,
        lambda exc: _unavailable(f"the image model is unavailable: {exc}", "dit_unavailable", exc.retry_after or "1"),
    ),
    (RowQueueOverflow, lambda exc: _unavailable(str(exc), "handoff_backpressure", "1")),
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


@dataclass(frozen=True)
class ImagesAnswer:
    """A JSON answer, with the stage times for its ``server-timing`` header (seconds)."""

    body: ImagesResponse
    timings: dict[str, float]


@dataclass(frozen=True)
class StreamError:
    """A failure after the stream started: the status line is sent, so it is an ``error`` event."""

    error: ApiError


ImageEvent = PartialImageEvent | CompletedEvent | StreamError
ImageEvents = AsyncIterator[ImageEvent]


@dataclass(frozen=True)
class ImageServing:
    settings: ArSettings
    readiness: ArReadiness
    validator: RequestValidator
    admission: RequestAdmission
    generator: ImageGenerator
    store: ImageStore
    metrics: ArMetrics
    drain: Drain

    async def create_images(self, body: ImageGenerationRequest, raw_request: Request) -> ImagesAnswer | ImageEvents:
        received_at = time.perf_counter()
        with _left_on_failure(take_place(raw_request)) as place:
            dit, _ = await self.readiness.require()
            valid = self.validator.generation(
                body, raw_request.state.request_id, received_at, dit, _tenant(raw_request)
            )
        return await self._serve(valid, place, raw_request)

    async def create_edit(self, raw_request: Request) -> ImagesAnswer | ImageEvents:
        received_at = time.perf_counter()
        with _left_on_failure(take_place(raw_request)) as place:
            valid = await self._valid_edit(raw_request, received_at)
        return await self._serve(valid, place, raw_request)

    async def _valid_edit(self, raw_request: Request, received_at: float) -> ValidGeneration:
        """The edit checked and decoded; its uploaded files (up to the edit body cap) are not kept past here."""
        form = await read_edit_form(raw_request)
        dit, _ = await self.readiness.require()
        return await self.validator.edit(form, raw_request.state.request_id, received_at, dit, _tenant(raw_request))

    async def _serve(
        self, valid: ValidGeneration, place: AdmissionPlace, raw_request: Request
    ) -> ImagesAnswer | ImageEvents:
        # Every refusal known before any work is an HTTP status, in stream mode too: 429 or 503 at the door
        # (admission decides at arrival), then 404 / 400 (validation), then 429 once priced (the requests of its
        # burst before it turned out heavier than the default); an admitted request may wait its turn.
        try:
            place.price(Load.of(valid.generation.diffusion), _tenant(raw_request))
            turn = place.turn()
            async with self.drain.bounded():  # a replica that is shutting down stops waiting at its deadline
                ticket = await (turn if place.started else cancel_on_disconnect(raw_request, turn))
        except BaseException:
            place.leave()
            valid.release()
            raise
        if valid.response.stream:
            # The work starts now and gives its slot (and an edit's memory) back when it ends, whether or
            # not the client has read its events: a stalled reader holds no capacity.
            partials: asyncio.Queue[PartialImageFrame | None] = asyncio.Queue()  # None: the generation is over
            task = asyncio.ensure_future(self._generate(valid, partials.put))
            task.add_done_callback(lambda done: _over(done, ticket, valid, partials))
            return self._events(valid, task, partials)
        served = False
        try:
            result = await cancel_on_disconnect(raw_request, self._generate(valid))
            served = True
        finally:
            ticket.release(served)
            valid.release()
        return ImagesAnswer(await self._response(valid, result), result.timings)

    async def _events(
        self,
        valid: ValidGeneration,
        task: asyncio.Future[GenerationResult],
        partials: asyncio.Queue[PartialImageFrame | None],
    ) -> ImageEvents:
        """Partial images as they come, then one completed event per image; a failure after the
        stream started arrives as a ``StreamError``."""
        try:
            while (frame := await partials.get()) is not None:
                yield self._partial_event(valid, frame)
            for event in self._completed_events(valid, task.result()):
                yield event
        except (asyncio.CancelledError, GeneratorExit):
            # The one line a client that leaves mid-stream is worth (the server stopping reads alike).
            log.info("the stream was closed before its end (the client left); its work is cancelled")
            raise
        except ApiError as exc:
            self.metrics.app.count_error(exc)
            yield StreamError(exc)
        except Exception:
            log.exception("stream failed")
            error = ApiError(500, "the stream failed; the server's log has the details", code="internal_error")
            self.metrics.app.count_error(error)
            yield StreamError(error)
        finally:
            task.cancel()

    async def _generate(
        self, valid: ValidGeneration, on_partial_image: PartialImageSink | None = None
    ) -> GenerationResult:
        gen = valid.generation
        # Draining, work still running at the deadline ends with a 503 (an ``error`` event in a stream).
        with self._observed(valid), map_failures():
            async with self.drain.bounded():
                result = await self.generator.generate(gen, on_partial_image)
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
    def _observed(self, valid: ValidGeneration) -> Iterator[None]:
        """Counts one image request by outcome and times it, for the JSON and the SSE path alike."""
        status = "error"
        try:
            yield
            status = "ok"
        finally:
            self.metrics.requests.labels(status=status).inc()
            self.metrics.request_seconds.observe(time.perf_counter() - valid.generation.received_at)

    async def _response(self, valid: ValidGeneration, result: GenerationResult) -> ImagesResponse:
        options, data = valid.response, []
        for image in _in_order(result.images):
            if options.response_format == "url":
                item = ImageData(url=await self._stored(image, options.owner))
            else:
                item = ImageData(b64_json=_b64(image.data))
            data.append(item.model_copy(update={"revised_prompt": result.revised_prompt}))
        return ImagesResponse(
            created=int(time.time()),
            data=data,
            output_format=valid.generation.diffusion.output_format,
            size=valid.generation.diffusion.size,
            quality=options.quality,
            safety_identifier=options.safety_identifier,
            usage=usage(result),
        )

    async def _stored(self, image: ImageFrame, owner: str) -> str:
        # Validation let url through only where the base is configured: a request's Host never names it.
        base_url = self.settings.image_base_url
        assert base_url is not None
        try:
            name = await self.store.put(image.data, image.output_format, owner)
        except ImageTooLargeForStore as exc:
            raise ApiError(
                400, f"{exc}; ask for response_format=b64_json", param="response_format", code="unsupported_value"
            ) from None
        except ImageStoreUnavailable as exc:
            raise _store_unavailable(exc) from None
        return f"{base_url.rstrip('/')}/v1/images/{name}"

    @staticmethod
    def _partial_event(valid: ValidGeneration, frame: PartialImageFrame) -> PartialImageEvent:
        options, diffusion = valid.response, valid.generation.diffusion
        return PartialImageEvent(
            type=f"{options.event_prefix}.partial_image",
            b64_json=_b64(frame.data),
            created_at=int(time.time()),
            partial_image_index=frame.partial_image_index,
            image_index=frame.image_index,
            output_format=diffusion.output_format,
            quality=options.quality or "auto",
            size=diffusion.size,
        )

    @staticmethod
    def _completed_events(valid: ValidGeneration, result: GenerationResult) -> list[CompletedEvent]:
        options, diffusion = valid.response, valid.generation.diffusion
        return [
            CompletedEvent(
                type=f"{options.event_prefix}.completed",
                b64_json=_b64(image.data),
                created_at=int(time.time()),
                output_format=diffusion.output_format,
                quality=options.quality or "auto",
                size=diffusion.size,
                safety_identifier=options.safety_identifier,
                usage=usage(result),
            )
            for image in _in_order(result.images)
        ]

    async def models(self) -> ModelList:
        return ModelList(data=[await self.model()])

    async def model(self, model_id: str | None = None) -> ModelObject:
        self.validator.check_model(model_id)
        capabilities = await self.readiness.capabilities()
        if capabilities is None:
            return ModelObject(id=self.settings.served_model_name)
        return ModelObject(
            id=self.settings.served_model_name, description=capabilities.description, sizes=capabilities.limits.sizes
        )

    def rendered_prompt(self, body: RenderRequest, request_id: str) -> list[RenderedPrompt]:
        """The templated prompt's token ids, as vLLM's /v1/completions/render gives them."""
        self.validator.check_model(body.model)
        return [RenderedPrompt(request_id=request_id, token_ids=self.validator.prompt_token_ids(body.prompt))]

    async def stored_image(self, name: str) -> StoredImage:
        """A ``response_format=url`` image, by the name its URL carries."""
        try:
            image = await self.store.get(name)
        except ImageStoreUnavailable as exc:
            raise _store_unavailable(exc) from None
        if image is None:
            raise ApiError(404, "image not found or expired", code="not_found", param="name")
        return image


def _store_unavailable(exc: ImageStoreUnavailable) -> ApiError:
    return ApiError(503, f"{exc}; retry, or ask for response_format=b64_json", code="image_store_unavailable")


def _tenant(raw_request: Request) -> str | None:
    """Whose API key sent the request (``services.request_gate`` names it); None without keys."""
    return getattr(raw_request.state, "tenant", None)


@contextmanager
def _left_on_failure(place: AdmissionPlace) -> Iterator[AdmissionPlace]:
    """A request refused before it is served gives its admission place back."""
    try:
        yield place
    except BaseException:
        place.leave()
        raise


def _over(
    done: asyncio.Future[GenerationResult],
    ticket: AdmissionTicket,
    valid: ValidGeneration,
    partials: asyncio.Queue[PartialImageFrame | None],
) -> None:
    """A stream's generation ended: its slot and memory go back, and its events learn it is over."""
    # The exception is read here in any case: a stream whose client left never reads it.
    ticket.release(served=not done.cancelled() and done.exception() is None)
    valid.release()
    partials.put_nowait(None)


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
            log.info("the client closed the request before its answer; its work is cancelled")
            raise ApiError(499, "client closed the request", code="client_closed_request") from None
        raise
    finally:
        watcher.cancel()


def usage(result: GenerationResult) -> Usage:
    u = result.usage
    return Usage(
        input_tokens=u.prompt_tokens,
        input_tokens_details=InputTokensDetails(
            text_tokens=u.prompt_tokens - u.picture_tokens, image_tokens=u.picture_tokens, cached_tokens=u.cached_tokens
        ),
        output_tokens=u.generated_tokens,
        output_tokens_details=OutputTokensDetails(text_tokens=u.generated_tokens),
        total_tokens=u.prompt_tokens + u.generated_tokens,
        cached_tokens=u.cached_tokens,
        cache_creation_tokens=u.cache_creation_tokens,
    )


def _in_order(images: list[ImageFrame]) -> list[ImageFrame]:
    return sorted(images, key=lambda i: i.image_index)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
