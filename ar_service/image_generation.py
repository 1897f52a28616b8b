"""One image request through the AR: prompts → engine runs → handoff body → DiT → images.

``ImageGenerator.generate`` builds the templated prompts (and the CFG negative one), starts their
engine runs inside a ``HandoffBody``, and hands that body to the ``HandoffClient``, which streams
it to the DiT and reads the images back. Nothing calls back into this module: data flows one way.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from ar_service.engine.hidden_state_engine import EngineRequest, HiddenStateEngine
from ar_service.engine.row_channel import RowQueueOverflow
from ar_service.handoff_body import NO_PIXELS, HandoffBody
from ar_service.handoff_client import HandoffFailed, PartialImageSink, RenderResult
from ar_service.input_images import EditPixels
from ar_service.metrics import ROW_BUFFER_OVERFLOW, ArMetrics
from ar_service.prompt_builder import BuiltPrompt, PromptBuilder
from ar_service.settings import ArSettings
from services.tracing import current_traceparent
from shared.frames import DiffusionParams, EditSpec, OpenFrame, PixelRole, StreamName, StreamSpec
from shared.handoff_encoder import HandoffEncoder
from shared.result_frames import ImageFrame
from shared.tensor_codec import wire_dtype

log = logging.getLogger("ardit.ar.generation")
tracer = trace.get_tracer("ardit.ar")

# The public parameter each stream's text comes from.
_PUBLIC_PARAM: dict[StreamName, str] = {"cond": "prompt", "uncond": "negative_prompt"}


class DitRenderer(Protocol):
    """Where a handoff body goes: one DiT (``HandoffClient``) or a pool of them (``DitPool``)."""

    async def render(
        self, request_id: str, body: HandoffBody, on_partial_image: PartialImageSink | None = None
    ) -> RenderResult: ...


@dataclass(frozen=True)
class EditInput:
    """An edit: what the open frame announces, and the pixels that follow it."""

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
    request_id: str
    prompt: str
    diffusion: DiffusionParams
    # The DiT's announced limit on rows after the template prefix (checked before engine work).
    max_conditioning_rows: int
    negative_prompt: str | None = None  # set → CFG with an unconditional stream
    max_new_tokens: int = 1
    cache_salt: str | None = None
    received_at: float = field(default_factory=time.perf_counter)
    edit: EditInput | None = None


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


class PromptTooLong(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class ImageGenerator:
    def __init__(
        self,
        settings: ArSettings,
        engine: HiddenStateEngine,
        prompts: PromptBuilder,
        dit: DitRenderer,
        metrics: ArMetrics,
    ) -> None:
        self._settings = settings
        self._engine = engine
        self._prompts = prompts
        self.dit = dit  # public: tests point a running service at another DiT
        self._metrics = metrics

    async def generate(
        self, request: GenerationRequest, on_partial_image: PartialImageSink | None = None
    ) -> GenerationResult:
        prompts = self._prompts_of(request)
        engine_requests = {
            name: EngineRequest(
                engine_request_id=f"{request.request_id}:{name}:{uuid.uuid4().hex[:8]}",
                prompt_token_ids=prompt.token_ids,
                max_new_tokens=request.max_new_tokens if name == "cond" else 1,  # the negative side only encodes
                cache_salt=request.cache_salt,
            )
            for name, prompt in prompts.items()
        }
        # The engine runs and the DiT's spans (through the open frame's traceparent) are its children.
        with tracer.start_as_current_span(
            "ardit.ar.handoff", kind=SpanKind.CLIENT, attributes={"ardit.request_id": request.request_id}
        ) as span:
            encoder = HandoffEncoder(self._open_frame(request, prompts, engine_requests))
            runs = {name: self._engine.run(r) for name, r in engine_requests.items()}
            body = HandoffBody(
                encoder,
                runs,
                overlap=self._settings.overlap_handoff,
                received_at=request.received_at,
                pixels=request.edit.frames if request.edit is not None else NO_PIXELS,
            )
            self._metrics.handoffs_in_flight.inc()
            try:
                async with body:
                    result = await self.dit.render(request.request_id, body, on_partial_image)
            except (HandoffFailed, RowQueueOverflow) as exc:
                reason = exc.reason if isinstance(exc, HandoffFailed) else ROW_BUFFER_OVERFLOW
                log.warning("handoff failed (%s): %s", reason, exc)
                self._metrics.handoff_failures.labels(reason=reason).inc()
                span.set_attribute("ardit.handoff.failure_reason", reason)
                raise
            finally:
                self._metrics.handoffs_in_flight.dec()
            span.set_attributes(
                {"ardit.handoff.sent_bytes": body.stats.bytes_sent, "ardit.handoff.sent_frames": body.stats.frames_sent}
            )
        return self._result(request, body, result)

    def prompt_token_ids(self, prompt: str) -> list[int]:
        """The ids the engine gets for ``prompt`` (in the template): what its prefix cache holds."""
        return self._prompts.build(prompt).token_ids

    def _prompts_of(self, request: GenerationRequest) -> dict[StreamName, BuiltPrompt]:
        texts: dict[StreamName, str] = {"cond": request.prompt}
        if request.negative_prompt is not None:
            texts["uncond"] = request.negative_prompt
        built: dict[StreamName, BuiltPrompt] = {}
        for name, text in texts.items():
            prompt = self._prompts.build(text)
            param = _PUBLIC_PARAM[name]
            if len(prompt.token_ids) > self._settings.max_prompt_tokens:
                raise PromptTooLong(
                    f"{param} is {len(prompt.token_ids)} tokens with the template; "
                    f"the limit is {self._settings.max_prompt_tokens}",
                    param,
                )
            rows = len(prompt.token_ids) - prompt.prefix_tokens
            if rows > request.max_conditioning_rows:
                raise PromptTooLong(
                    f"{param} is {rows} tokens; the image model takes at most {request.max_conditioning_rows}", param
                )
            built[name] = prompt
        return built

    def _open_frame(
        self,
        request: GenerationRequest,
        prompts: dict[StreamName, BuiltPrompt],
        engine_requests: dict[StreamName, EngineRequest],
    ) -> OpenFrame:
        return OpenFrame(
            request_id=request.request_id,
            model=self._settings.model_dir.name,
            conditioning=self._settings.conditioning,
            dtype=wire_dtype(self._engine.dtype),
            hidden_size=self._engine.shape.hidden_size,
            layer=self._engine.layer,
            final_norm=self._settings.final_norm,
            streams={
                name: StreamSpec(
                    prompt_tokens=len(prompt.token_ids),
                    max_rows=len(prompt.token_ids) + engine_requests[name].max_new_tokens - 1,
                    prefix_tokens=prompt.prefix_tokens,
                )
                for name, prompt in prompts.items()
            },
            diffusion=request.diffusion,
            traceparent=current_traceparent(),
            edit=request.edit.spec if request.edit is not None else None,
        )

    def _result(self, request: GenerationRequest, body: HandoffBody, result: RenderResult) -> GenerationResult:
        stats, finished, cond = body.stats, body.finished.values(), body.cond
        usage = TokenUsage(
            prompt_tokens=sum(f.prompt_tokens for f in finished),
            generated_tokens=len(cond.generated_token_ids),
            cached_tokens=sum(f.cached_tokens for f in finished),
            cache_creation_tokens=sum(f.cache_creation_tokens for f in finished),
        )
        ar = body.ar_timings()
        m = self._metrics
        m.handoff_sent_bytes.inc(stats.bytes_sent)
        m.handoff_sent_frames.inc(stats.frames_sent)
        if stats.handoff_latency is not None:
            m.handoff_latency_seconds.observe(stats.handoff_latency)
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
            "handoff_tail": stats.handoff_latency or 0.0,
            **{f"dit_{name}": seconds for name, seconds in result.done.timings.items()},
            "total": time.perf_counter() - request.received_at,
        }
        revised = self._prompts.decode(cond.generated_token_ids) if request.max_new_tokens > 1 else None
        return GenerationResult(images=result.images, usage=usage, revised_prompt=revised, timings=timings)
