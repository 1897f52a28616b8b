"""One validated request through the AR: engine runs → handoff body → a DiT → images.

``ImageGenerator.generate`` takes a ``GenerationRequest`` (made only by ``api/validation.py``, after
every check: its prompts are already templated and within the limits), starts the engine runs of its
streams inside a ``HandoffBody``, and hands that body to the DiTs (``DitPool``), which stream it and
return the images with a report of what was sent. The result comes back as a ``GenerationResult``:
images, token usage, stage timings. Nothing calls back into this module: data flows one way.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from ar_service.engine.hidden_state_engine import EngineRequest, HiddenStateEngine
from ar_service.engine.row_channel import RowQueueOverflow
from ar_service.handoff_body import ArTimings, HandoffBody
from ar_service.handoff_client import HandoffFailed, HandoffResult, PartialImageSink
from ar_service.input_images import EditPixels
from ar_service.metrics import ROW_BUFFER_OVERFLOW, ArMetrics
from ar_service.prompt_builder import BuiltPrompt, PromptBuilder
from ar_service.settings import ArSettings
from services.tracing import current_traceparent
from shared.diffusion import DiffusionParams
from shared.frames import EditSpec, OpenFrame, PixelRole, StreamName, StreamSpec
from shared.handoff_encoder import HandoffEncoder
from shared.result_frames import ImageFrame
from shared.tensor_codec import wire_dtype

log = logging.getLogger("ardit.ar.generation")
tracer = trace.get_tracer("ardit.ar")


class DitExchange(Protocol):
    """Where a handoff body goes: one DiT (``HandoffClient``) or a pool of them (``DitPool``)."""

    async def exchange(
        self, request_id: str, body: HandoffBody, on_partial_image: PartialImageSink | None = None
    ) -> HandoffResult: ...


@dataclass(frozen=True)
class EditHandoff:
    """An edit as it travels: what the open frame announces, and the pixels frames that follow it."""

    spec: EditSpec
    pixels: EditPixels

    @property
    def frames(self) -> dict[PixelRole, bytes]:
        frames: dict[PixelRole, bytes] = {"image": self.pixels.image}
        if self.pixels.mask is not None:
            frames["mask"] = self.pixels.mask
        return frames


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


@dataclass(frozen=True)
class TokenUsage:
    prompt_tokens: int
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
    dits: DitExchange
    metrics: ArMetrics

    async def generate(
        self, request: GenerationRequest, on_partial_image: PartialImageSink | None = None
    ) -> GenerationResult:
        engine_requests = {
            name: EngineRequest(
                engine_request_id=f"{request.request_id}:{name}:{uuid.uuid4().hex[:8]}",
                prompt_token_ids=prompt.token_ids,
                max_new_tokens=request.max_new_tokens if name == "cond" else 1,  # the negative side only encodes
                cache_salt=request.cache_salt,
            )
            for name, prompt in request.prompts.items()
        }
        # The engine runs and the DiT's spans (through the open frame's traceparent) are its children.
        with tracer.start_as_current_span(
            "ardit.ar.handoff", kind=SpanKind.CLIENT, attributes={"ardit.request_id": request.request_id}
        ) as span:
            body = HandoffBody(
                HandoffEncoder(self._open_frame(request, engine_requests)),
                {name: self.engine.run(r) for name, r in engine_requests.items()},
                overlap=self.settings.overlap_handoff,
                received_at=request.received_at,
                pixels=request.edit.frames if request.edit is not None else {},
            )
            self.metrics.handoffs_in_flight.inc()
            try:
                async with body:
                    result = await self.dits.exchange(request.request_id, body, on_partial_image)
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

    def _open_frame(self, request: GenerationRequest, engine_requests: Mapping[StreamName, EngineRequest]) -> OpenFrame:
        return OpenFrame(
            request_id=request.request_id,
            model=self.settings.model_dir.name,
            conditioning=self.settings.conditioning,
            dtype=wire_dtype(self.engine.dtype),
            hidden_size=self.engine.shape.hidden_size,
            layer=self.engine.layer,
            final_norm=self.settings.final_norm,
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
            generated_tokens=len(cond.generated_token_ids),
            cached_tokens=sum(f.cached_tokens for f in finished),
            cache_creation_tokens=sum(f.cache_creation_tokens for f in finished),
        )
        ar = ArTimings.of(request.received_at, cond)
        m = self.metrics
        m.handoff_sent_bytes.inc(report.bytes_sent)
        m.handoff_sent_frames.inc(report.frames_sent)
        m.handoff_latency_seconds.observe(report.handoff_latency)
        m.prompt_tokens.inc(usage.prompt_tokens)
        m.generated_tokens.inc(usage.generated_tokens)
        m.cached_tokens.inc(usage.cached_tokens)
        m.cache_creation_tokens.inc(usage.cache_creation_tokens)
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
