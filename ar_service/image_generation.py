"""One image request end to end on the AR side: prompts → engine streams → handoff → images.

The conditional prompt (and, for CFG, the negative prompt) run as engine requests at once; a
pump task per stream moves engine events into one queue, and the handoff body turns them into
frames as they come, so rows travel while the engine is still decoding. With
``stream_handoff`` off, every row is gathered first and sent after the AR finishes (the baseline
the e2e benchmark compares against).

Everything a request holds — engine requests, row streams, the DiT exchange — is released in one
``finally``: a client that disconnects cancels the task, which aborts the engine requests and
drops the DiT connection (the DiT then stops at its next step).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ar_service.engine import EngineRequest, FinishedEvent, HiddenStateEngine, RowsEvent
from ar_service.handoff_client import HandoffClient, HandoffStats, PartialImageSink
from ar_service.metrics import ArMetrics
from ar_service.prompt_builder import PromptBuilder
from ar_service.settings import ArSettings
from shared.frame_types import Buffer
from shared.frames import DiffusionParams, OpenFrame, StreamName, StreamSpec
from shared.handoff_encoder import HandoffEncoder
from shared.result_frames import ImageFrame
from shared.tensor_codec import wire_dtype

log = logging.getLogger("ardit.ar.generation")


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt: str
    diffusion: DiffusionParams
    negative_prompt: str | None = None  # set → CFG with an unconditional stream
    max_new_tokens: int = 1
    cache_salt: str | None = None
    received_at: float = field(default_factory=time.perf_counter)


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
    pass


class ImageGenerator:
    def __init__(
        self,
        settings: ArSettings,
        engine: HiddenStateEngine,
        prompts: PromptBuilder,
        dit: HandoffClient,
        metrics: ArMetrics,
    ) -> None:
        self._settings = settings
        self._engine = engine
        self._prompts = prompts
        self.dit = dit  # public: tests point a running service at another DiT
        self._metrics = metrics

    async def generate(self, request: GenerationRequest, on_partial_image: PartialImageSink | None = None) -> GenerationResult:
        engine_requests = self._engine_requests(request)
        open_frame = self._open_frame(request, engine_requests)
        encoder = HandoffEncoder(open_frame)
        events: asyncio.Queue = asyncio.Queue()
        finished: dict[StreamName, FinishedEvent] = {}
        stats = HandoffStats()
        pumps = [
            asyncio.create_task(self._pump(name, engine_request, events), name=f"pump-{engine_request.stream_id}")
            for name, engine_request in engine_requests.items()
        ]

        async def frames(enc: HandoffEncoder) -> AsyncIterator[list[Buffer]]:
            yield enc.open_frame()
            held: list[tuple[StreamName, RowsEvent]] = []
            while len(finished) < len(engine_requests):
                name, event = await events.get()
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, FinishedEvent):
                    finished[name] = event
                elif self._settings.stream_handoff:
                    for frame in enc.row_frames(name, event.start, event.token_ids, event.rows):
                        yield frame
                else:
                    held.append((name, event))
            # The handoff tail starts here, whether rows already went out or are still held.
            stats.last_row_at = time.perf_counter()
            for name, event in held:
                for frame in enc.row_frames(name, event.start, event.token_ids, event.rows):
                    yield frame
            yield enc.close(
                token_ids={name: f.token_ids for name, f in finished.items()},
                answer_start_index={name: f.prompt_tokens for name, f in finished.items()},
                cached_tokens=sum(f.cached_tokens for f in finished.values()),
                cache_creation_tokens=sum(f.cache_creation_tokens for f in finished.values()),
                timings=self._ar_timings(request, finished["cond"]),
            )

        self._metrics.handoffs_in_flight.inc()
        try:
            result = await self.dit.render(encoder, frames, on_partial_image, stats)
        finally:
            self._metrics.handoffs_in_flight.dec()
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        self._metrics.handoff_bytes_sent.inc(result.stats.bytes_sent)
        self._metrics.handoff_frames_sent.inc(result.stats.frames_sent)
        if result.stats.handoff_latency is not None:
            self._metrics.handoff_latency_seconds.observe(result.stats.handoff_latency)

        cond = finished["cond"]
        usage = TokenUsage(
            prompt_tokens=sum(f.prompt_tokens for f in finished.values()),
            generated_tokens=len(cond.generated_token_ids),
            cached_tokens=sum(f.cached_tokens for f in finished.values()),
            cache_creation_tokens=sum(f.cache_creation_tokens for f in finished.values()),
        )
        self._observe_usage(request, cond, usage)
        revised = self._prompts.decode(cond.generated_token_ids) if request.max_new_tokens > 1 else None
        timings = {
            **self._ar_timings(request, cond),
            "handoff_tail": result.stats.handoff_latency or 0.0,
            **{f"dit_{name}": seconds for name, seconds in (result.done.timings if result.done else {}).items()},
            "total": time.perf_counter() - request.received_at,
        }
        return GenerationResult(images=result.images, usage=usage, revised_prompt=revised, timings=timings)

    def _engine_requests(self, request: GenerationRequest) -> dict[StreamName, EngineRequest]:
        streams: dict[StreamName, tuple[str, int]] = {"cond": (request.prompt, request.max_new_tokens)}
        if request.negative_prompt is not None:
            streams["uncond"] = (request.negative_prompt, 1)  # the negative side only encodes
        built = {}
        for name, (text, max_new) in streams.items():
            prompt = self._prompts.build(text)
            if len(prompt.token_ids) > self._settings.max_prompt_tokens:
                raise PromptTooLong(
                    f"{'negative_prompt' if name == 'uncond' else 'prompt'} is {len(prompt.token_ids)} tokens "
                    f"with the template; the limit is {self._settings.max_prompt_tokens}"
                )
            built[name] = EngineRequest(
                stream_id=f"{request.request_id}:{name}:{uuid.uuid4().hex[:8]}",
                prompt_token_ids=prompt.token_ids,
                max_new_tokens=max_new,
                cache_salt=request.cache_salt,
            )
        return built

    def _open_frame(self, request: GenerationRequest, engine_requests: dict[StreamName, EngineRequest]) -> OpenFrame:
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
                    prompt_tokens=len(r.prompt_token_ids),
                    max_rows=len(r.prompt_token_ids) + r.max_new_tokens - 1,
                )
                for name, r in engine_requests.items()
            },
            diffusion=request.diffusion,
        )

    async def _pump(self, name: StreamName, request: EngineRequest, events: asyncio.Queue) -> None:
        try:
            async for event in self._engine.stream(request):
                await events.put((name, event))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the body, which fails the handoff with it
            await events.put((name, exc))

    @staticmethod
    def _ar_timings(request: GenerationRequest, cond: FinishedEvent) -> dict[str, float]:
        return {
            "queue": max(0.0, cond.submitted_at - request.received_at),
            "ttft": max(0.0, cond.first_token_at - request.received_at),
            "decode": max(0.0, cond.finished_at - cond.first_token_at),
            "ar_total": max(0.0, cond.finished_at - request.received_at),
        }

    def _observe_usage(self, request: GenerationRequest, cond: FinishedEvent, usage: TokenUsage) -> None:
        m = self._metrics
        m.prompt_tokens.inc(usage.prompt_tokens)
        m.generated_tokens.inc(usage.generated_tokens)
        m.cached_tokens.inc(usage.cached_tokens)
        m.cache_creation_tokens.inc(usage.cache_creation_tokens)
        m.cached_tokens_per_request.observe(usage.cached_tokens)
        m.cache_creation_tokens_per_request.observe(usage.cache_creation_tokens)
        m.ttft_seconds.observe(max(0.0, cond.first_token_at - request.received_at))
        m.ar_seconds.observe(max(0.0, cond.finished_at - cond.submitted_at))
