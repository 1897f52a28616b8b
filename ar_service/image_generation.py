"""One validated request through the AR: engine runs → handoff body → a DiT → images.

``ImageGenerator.generate`` takes a ``GenerationRequest`` (made only by ``api/validation.py``, after
every check: its prompts are already templated and within the limits), starts the engine runs of its
streams inside a ``HandoffBody`` once a DiT has reserved it a place (``DitPool``), and sends that body
to the DiT, which returns the images with a report of what was sent. The result comes back as a
``GenerationResult``: images, token usage, stage timings. Nothing calls back into this module: data
flows one way. An engine that dies meanwhile ends the request at once with ``EngineUnavailable``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import PIL.Image
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from ar_service.dit_pool import ReservedDit
from ar_service.engine.hidden_state_engine import EngineEvent, EngineRequest, EngineUnavailable, HiddenStateEngine
from ar_service.engine.row_channel import RowQueueOverflow
from ar_service.handoff_body import ArTimings, HandoffBody
from ar_service.handoff_client import HandoffFailed, HandoffResult, PartialImageSink
from ar_service.input_images import EditPixels
from ar_service.metrics import ROW_BUFFER_OVERFLOW, ArMetrics
from ar_service.negative_rows import NegativeRows
from ar_service.prompt_builder import BuiltPrompt, PromptBuilder
from ar_service.settings import ArSettings
from services.tracing import current_traceparent
from shared.diffusion import DiffusionParams
from shared.frames import EditSpec, OpenFrame, PictureSpec, PixelsPlace, StreamName, StreamSpec
from shared.handoff_encoder import HandoffEncoder
from shared.result_frames import ImageFrame
from shared.tensor_codec import wire_dtype

log = logging.getLogger("ardit.ar.generation")
tracer = trace.get_tracer("ardit.ar")


class DiTs(Protocol):
    """Where a request's handoff goes: a place reserved at a DiT (``DitPool``), before any engine work."""

    def reserve(self, request_id: str) -> AbstractAsyncContextManager[ReservedDit]: ...


@dataclass(frozen=True)
class EditHandoff:
    """An edit as it travels: what the open frame announces, and the pixels frames that follow it, by role and
    index in the order they are sent (each picture, then the mask)."""

    spec: EditSpec
    frames: dict[PixelsPlace, bytes]

    @classmethod
    def of(cls, strength: float | None, pixels: EditPixels) -> EditHandoff:
        """``strength``: None for a reference edit."""
        frames: dict[PixelsPlace, bytes] = {("image", index): p.data for index, p in enumerate(pixels.pictures)}
        if pixels.mask is not None:
            frames["mask", 0] = pixels.mask
        pictures = [PictureSpec(width=p.width, height=p.height) for p in pixels.pictures]
        return cls(EditSpec(pictures=pictures, strength=strength, mask=pixels.mask is not None), frames)

    def take_frames(self) -> dict[PixelsPlace, bytes]:
        """The pixels, given up once to whoever sends them: with the only reference, they are freed as soon
        as they are written, not when the request ends."""
        taken = dict(self.frames)
        self.frames.clear()
        return taken


@dataclass(frozen=True)
class GenerationRequest:
    """A request as the AR runs it. Only validation makes one, after every check that needs no model."""

    request_id: str
    # The templated prompt of each stream: ``cond``, and ``uncond`` (the negative prompt) with CFG.
    prompts: Mapping[StreamName, BuiltPrompt]
    diffusion: DiffusionParams
    max_new_tokens: int
    cache_salt: str | None
    received_at: float  # perf_counter when the HTTP request arrived
    edit: EditHandoff | None = None
    # What the encoder reads with every stream's prompt (an edit model's pictures, at its condition size), in order.
    pictures: tuple[PIL.Image.Image, ...] = ()


@dataclass(frozen=True)
class TokenUsage:
    prompt_tokens: int  # pictures' tokens included
    picture_tokens: int
    pictures_read: int
    pictures_encoded: int
    generated_tokens: int
    cached_tokens: int
    cache_creation_tokens: int


@dataclass(frozen=True)
class GenerationResult:
    images: list[ImageFrame]
    usage: TokenUsage
    revised_prompt: str | None
    timings: dict[str, float]  # seconds, by stage


@dataclass(frozen=True)
class ImageGenerator:
    settings: ArSettings
    engine: HiddenStateEngine
    prompts: PromptBuilder
    dits: DiTs
    metrics: ArMetrics
    negative_rows: NegativeRows

    async def generate(
        self, request: GenerationRequest, on_partial_image: PartialImageSink | None = None
    ) -> GenerationResult:
        engine_requests = {
            name: EngineRequest(
                engine_request_id=f"{request.request_id}:{name}:{uuid.uuid4().hex[:8]}",
                prompt_token_ids=prompt.token_ids,
                max_new_tokens=request.max_new_tokens if name == "cond" else 1,  # the negative side only encodes
                cache_salt=request.cache_salt,
                pictures=request.pictures,
                engine_token_ids=prompt.engine_token_ids,
            )
            for name, prompt in request.prompts.items()
        }
        # The engine runs and the DiT's spans (through the open frame's traceparent) are its children.
        with tracer.start_as_current_span(
            "ardit.ar.handoff", kind=SpanKind.CLIENT, attributes={"ardit.request_id": request.request_id}
        ) as span:
            self.metrics.handoffs_in_flight.inc()
            try:
                # In flight until the DiT's images are back, not only while the engine runs: a render longer than
                # the idle delay would otherwise have the engine core give its pages back in every request.
                async with self.engine.idle_release.in_flight():
                    handoff = self._handoff(request, engine_requests, on_partial_image)
                    result = await _unless_dead(self.engine, handoff)
            except (HandoffFailed, RowQueueOverflow) as exc:
                reason = exc.reason if isinstance(exc, HandoffFailed) else ROW_BUFFER_OVERFLOW
                log.warning("handoff failed (%s): %s", reason, exc)
                self.metrics.handoff_failures.labels(reason=reason).inc()
                span.set_attribute("ardit.handoff.failure_reason", reason)
                raise
            finally:
                self.metrics.handoffs_in_flight.dec()
            report = result.report
            span.set_attributes(
                {"ardit.handoff.sent_bytes": report.bytes_sent, "ardit.handoff.sent_frames": report.frames_sent}
            )
        return self._result(request, result)

    async def _handoff(
        self,
        request: GenerationRequest,
        engine_requests: Mapping[StreamName, EngineRequest],
        on_partial_image: PartialImageSink | None,
    ) -> HandoffResult:
        if self.engine.dead:
            raise EngineUnavailable("the AR engine died")
        # A place at a DiT first: a full or absent DiT costs no engine work.
        async with self.dits.reserve(request.request_id) as dit:
            body = HandoffBody(
                HandoffEncoder(self._open_frame(request, engine_requests)),
                {name: self._run(name, r) for name, r in engine_requests.items()},
                overlap=self.settings.overlap_handoff,
                received_at=request.received_at,
                pixels=request.edit.take_frames() if request.edit is not None else {},
            )
            async with body:
                return await dit.exchange(body, on_partial_image)

    def _run(self, name: StreamName, request: EngineRequest) -> AbstractAsyncContextManager[AsyncIterator[EngineEvent]]:
        """The stream's engine run, to submit; a negative prompt's may be replayed from ``negative_rows``."""
        if name == "uncond":
            return self.negative_rows.submitted(self.engine, request)
        return self.engine.submitted(request)

    def _open_frame(self, request: GenerationRequest, engine_requests: Mapping[StreamName, EngineRequest]) -> OpenFrame:
        return OpenFrame(
            request_id=request.request_id,
            model=self.settings.model_dir.name,
            dtype=wire_dtype(self.engine.dtype),
            row_width=self.engine.row_width,
            rows=self.engine.rows,
            streams={
                name: StreamSpec(
                    prompt_tokens=len(prompt.token_ids),
                    max_rows=len(prompt.token_ids) + engine_requests[name].max_new_tokens - 1,
                    prefix_tokens=prompt.prefix_tokens,
                )
                for name, prompt in request.prompts.items()
            },
            diffusion=request.diffusion,
            traceparent=current_traceparent(),
            edit=request.edit.spec if request.edit is not None else None,
        )

    def _result(self, request: GenerationRequest, result: HandoffResult) -> GenerationResult:
        report = result.report
        finished, cond = report.finished.values(), report.finished["cond"]
        usage = TokenUsage(
            prompt_tokens=sum(f.prompt_tokens for f in finished),
            picture_tokens=sum(prompt.picture_tokens for prompt in request.prompts.values()),
            pictures_read=len(request.pictures) * len(request.prompts),
            pictures_encoded=sum(f.pictures_encoded for f in finished),
            generated_tokens=len(cond.generated_token_ids),
            cached_tokens=sum(f.cached_tokens for f in finished),
            cache_creation_tokens=sum(f.cache_creation_tokens for f in finished),
        )
        ar = ArTimings.of(request.received_at, report.finished)
        m = self.metrics
        m.handoff_sent_bytes.inc(report.bytes_sent)
        m.handoff_sent_frames.inc(report.frames_sent)
        m.handoff_latency_seconds.observe(report.handoff_latency)
        m.prompt_tokens.inc(usage.prompt_tokens)
        m.generated_tokens.inc(usage.generated_tokens)
        m.cached_tokens.inc(usage.cached_tokens)
        m.cache_creation_tokens.inc(usage.cache_creation_tokens)
        m.pictures_read.inc(usage.pictures_read)
        m.pictures_encoded.inc(usage.pictures_encoded)
        m.cached_tokens_per_request.observe(usage.cached_tokens)
        m.cache_creation_tokens_per_request.observe(usage.cache_creation_tokens)
        m.ttft_seconds.observe(ar.ttft)
        m.ar_seconds.observe(max(0.0, cond.finished_at - cond.submitted_at))
        timings = {
            **ar.as_dict(),
            "handoff_tail": report.handoff_latency,
            **{f"dit_{name}": seconds for name, seconds in result.done.timings.items()},
            "total": time.perf_counter() - request.received_at,
        }
        revised = self.prompts.decode(cond.generated_token_ids) if request.max_new_tokens > 1 else None
        return GenerationResult(images=result.images, usage=usage, revised_prompt=revised, timings=timings)


async def _unless_dead(engine: HiddenStateEngine, work: Coroutine[Any, Any, HandoffResult]) -> HandoffResult:
    """``work``'s result, or ``EngineUnavailable`` as soon as the engine dies, whatever stage the request is
    at (queued in the engine, prefilling, handing off, or rendering at the DiT): the service is about to
    exit, and every request in flight answers 503 rather than be cut when it does."""
    task = asyncio.ensure_future(work)
    death = asyncio.ensure_future(engine.died())
    try:
        done, _ = await asyncio.wait({task, death}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise EngineUnavailable("the AR engine died")
    finally:
        task.cancel()
        death.cancel()
        await asyncio.gather(task, death, return_exceptions=True)
