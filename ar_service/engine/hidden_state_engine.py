"""The AR engine: vLLM ``AsyncLLM`` in process, with hidden-state capture, as a stream of events.

``HiddenStateEngine.run(request)`` yields ``RowsEvent`` as rows become available — all prompt
rows right after prefill (cached rows included: they are read back from prefix-cached blocks),
then the rows of each decode step — and ends with one ``FinishedEvent`` carrying the token ids
and vLLM's cache counts. Rows are tagged with the token id of each row, so a generated row is
held until the token it belongs to has come out of the engine. ``submitted(request)`` is the same
in two steps, as vLLM's ``add_request`` and its output queue are: entering returns once the engine
holds the request, and its events follow; the handoff submits first and connects to its DiT while
the engine computes.

Row count = prompt + generated - 1: the last sampled token is never fed back, so it has no row.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import PIL.Image
import torch
from vllm.v1.engine.exceptions import EngineDeadError

from ar_service.engine.connector import PICTURES_ENCODED_KEY, ROW_COUNT_KEY, ROW_QUEUE_KEY, HiddenStateConnector
from ar_service.engine.row_channel import RowChannel, RowChunk, RowQueue
from ar_service.engine.text_model import TextModel, TextModelError
from ar_service.engine.vision_folder import linked_folder
from ar_service.settings import ArSettings
from services.heap import IdleRelease, collect_free_pages
from services.tracing import current_traceparent, otlp_traces_endpoint

if TYPE_CHECKING:
    from vllm import RequestOutput
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.output_processor import RequestOutputCollector

log = logging.getLogger("ardit.ar.engine")

# How often a running engine is checked for death: readiness, and every request in flight, learn of it within this.
DEATH_CHECK_SECONDS = 0.2
# The engine's worker on CPU (vLLM's, less what serving never uses), by path: only the engine core imports it.
CPU_WORKER_CLASS = "ar_service.engine.cpu_worker.CpuWorker"


@dataclass(frozen=True)
class EngineRequest:
    engine_request_id: str  # unique per engine request: vLLM's request id, and its row queue's
    # One id per prompt row: the prompt as the engine computes it, each picture's placeholder expanded to its tokens.
    prompt_token_ids: list[int]
    max_new_tokens: int = 1
    temperature: float = 0.0
    seed: int | None = None
    cache_salt: str | None = None
    # The pictures the prompt reads, in order, at the size the family's vision tower reads them; and the prompt as
    # vLLM takes it then, one placeholder a picture: vLLM expands each itself (and would expand expanded ones again).
    pictures: tuple[PIL.Image.Image, ...] = ()
    engine_token_ids: list[int] | None = None


@dataclass(frozen=True)
class RowsEvent:
    start: int
    rows: torch.Tensor  # [n, row width], source dtype, post-norm when configured
    token_ids: list[int]


@dataclass(frozen=True)
class FinishedEvent:
    token_ids: list[int]  # prompt + generated
    prompt_tokens: int
    generated_token_ids: list[int]
    row_count: int
    cached_tokens: int
    cache_creation_tokens: int
    submitted_at: float  # perf_counter at submission
    first_token_at: float  # perf_counter when the first generated token came out
    finished_at: float
    # Of the request's pictures, those the vision tower encoded (0 for each one whose embeddings vLLM still held).
    pictures_encoded: int = 0


EngineEvent = RowsEvent | FinishedEvent


class EngineUnavailable(RuntimeError):
    """The engine is not running (not started yet, or dead): no request can be served."""


class HiddenStateEngine:
    def __init__(self, settings: ArSettings) -> None:
        self.settings = settings
        self.text_model = TextModel.read(settings.model_dir)
        # How rows are read: the card of the pipeline folder served, else the demo's, as the settings override it.
        self.rows = settings.rows(self.text_model.card_rows)
        layers = self.text_model.num_hidden_layers
        if max(self.rows.layers) > layers:
            raise TextModelError(f"layers {self.rows.layers}: {settings.model_dir} has {layers} layers")
        if self.rows.layers != sorted(set(self.rows.layers)):
            # vLLM captures the layers in the order the model runs them, whatever order it is given.
            raise TextModelError(f"layers {self.rows.layers}: captured rows stack layers in increasing order")
        self.dtype = getattr(torch, settings.engine_dtype)
        self._engine: AsyncLLM | None = None
        self._channel: RowChannel | None = None
        self._socket_dir: tempfile.TemporaryDirectory[str] | None = None
        self._served_dir: tempfile.TemporaryDirectory[str] | None = None
        self._core_returns_pages = False
        self.idle_release = IdleRelease(settings.release_memory_idle_seconds, self._return_free_pages)

    @property
    def row_width(self) -> int:
        """The width of a captured row: each of its layers' outputs side by side."""
        return len(self.rows.layers) * self.text_model.hidden_size

    @property
    def block_size(self) -> int:
        return int(self._running().vllm_config.cache_config.block_size)

    @property
    def channel(self) -> RowChannel | None:
        return self._channel

    @property
    def vllm(self) -> AsyncLLM:
        """The underlying AsyncLLM (for counters tests and benchmarks read)."""
        return self._running()

    def start(self) -> None:
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        s = self.settings
        args = self._engine_args()
        started = time.perf_counter()
        config = args.create_engine_config()
        if current_platform.is_cpu() and config.parallel_config.world_size == 1:
            self._run_model_on_core_thread(config)
        if s.kv_cache_bytes is None:  # sized in tokens once vLLM has chosen the block size
            self._size_kv_cache_in_tokens(config)
        # The engine core's start-up is the AR's largest (weights, KV cache): what this process's own start-up
        # freed goes back first, so that the two do not add up in the peak.
        collect_free_pages()
        self._engine = AsyncLLM.from_vllm_config(config, disable_log_stats=False)
        log.info(
            "engine up in %.1fs: %s, block size %d, prefix caching %s, capture %s (layers %s, final norm %s)",
            time.perf_counter() - started,
            s.model_dir.name,
            self.block_size,
            s.enable_prefix_caching,
            s.capture_hidden_states,
            self.rows.layers,
            self.rows.final_norm,
        )

    def _engine_args(self) -> AsyncEngineArgs:
        """vLLM's engine arguments for the model and the settings, capture's included when it is on."""
        from vllm.config import CompilationConfig, CompilationMode, KVEventsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs

        s = self.settings
        extra = self._capture_config() if s.capture_hidden_states else {}
        return AsyncEngineArgs(
            **self.text_model.engine_args(self._served_folder()),
            dtype=s.engine_dtype,
            seed=s.seed,
            block_size=s.block_size,
            enable_prefix_caching=s.enable_prefix_caching,
            # sha256 block hashes are reproducible across processes and restarts.
            prefix_caching_hash_algo="sha256",
            kv_cache_memory_bytes=s.kv_cache_bytes,
            max_model_len=s.model_len,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            compilation_config=CompilationConfig(
                mode=CompilationMode.VLLM_COMPILE if s.compile else CompilationMode.NONE
            ),
            # Capture reads rows in the scheduler step that computed them; async scheduling
            # would make num_computed_tokens run ahead of what is written.
            async_scheduling=False,
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=s.kv_events_endpoint, topic=s.kv_events_topic
            )
            if s.kv_events_publisher == "zmq"
            else None,
            # vLLM's own request spans (queue, prefill, decode times) join ardit's traces when OTLP is on.
            otlp_traces_endpoint=otlp_traces_endpoint(),
            **extra,
        )

    def _served_folder(self) -> Path | None:
        """Where vLLM reads a picture-reading encoder from (``vision_folder``); None: its own folder."""
        model = self.text_model
        if model.processor_dir is None:
            return None
        if self._served_dir is None:
            self._served_dir = linked_folder(model.weights_dir, model.processor_dir)
        return Path(self._served_dir.name)

    def _run_model_on_core_thread(self, config: VllmConfig) -> None:
        """On CPU, the model runs on the engine core's own thread, as vLLM runs it at one GPU."""
        # vLLM's CPU platform swaps the in-process executor for its multiprocess one whenever the engine
        # core has a process of its own, as under AsyncLLM it always does. The model would then run in a
        # third process that imports torch and vLLM again and, for a second after every step, spins on the
        # shared-memory queue that feeds it, on a core the DiT needs (what it cost in memory and images:
        # benchmarks/results/memory_table.md). What is given up is vLLM's pinning of the
        # model's OpenMP threads to cores (VLLM_CPU_OMP_THREADS_BIND); OMP_NUM_THREADS still applies.
        config.parallel_config.distributed_executor_backend = "uni"
        # vLLM's CPU worker, less a copy of the vocabulary matrix serving never uses (cpu_worker).
        config.parallel_config.worker_cls = CPU_WORKER_CLASS
        self._core_returns_pages = True

    def _size_kv_cache_in_tokens(self, config: VllmConfig) -> None:
        """The KV cache the settings ask for in tokens, set in the bytes vLLM sizes it by."""
        cache = config.cache_config
        per_token = _kv_bytes_per_token(config, self.dtype, len(self.rows.layers))
        cache.kv_cache_memory_bytes = self.settings.kv_cache_tokens(cache.block_size) * per_token

    def _capture_config(self) -> dict[str, Any]:
        """The engine arguments that turn capture on, and the channel the rows will arrive on."""
        self._socket_dir = tempfile.TemporaryDirectory(prefix="ardit-rows-")
        self._channel = RowChannel(f"ipc://{self._socket_dir.name}/rows.sock")
        return {
            "speculative_config": {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.rows.layers}},
            },
            "kv_transfer_config": {
                "kv_connector": HiddenStateConnector.__name__,
                "kv_connector_module_path": HiddenStateConnector.__module__,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {
                    "rows_endpoint": self._channel.endpoint,
                    "final_norm": self.rows.final_norm,
                    "without_draft": self.settings.capture_without_draft,
                },
            },
        }

    async def aclose(self) -> None:
        """Stop the engine from the event loop it runs on. vLLM's own shutdown stops the engine process
        first and its output loop after, which then logs the process's end as an error with a
        traceback: the loop is stopped here first, so a normal stop prints none."""
        await self.idle_release.aclose()
        handler = getattr(self._engine, "output_handler", None)
        if handler is not None:
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._socket_dir is not None:
            self._socket_dir.cleanup()
        if self._served_dir is not None:
            self._served_dir.cleanup()
            self._served_dir = None

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._running().reset_prefix_cache())

    @property
    def dead(self) -> bool:
        """The engine ran and died (its core process is gone or its output loop ended)."""
        return self._engine is not None and bool(self._engine.errored)

    async def died(self) -> None:
        """Returns once the engine has died (vLLM flags it from its output loop; checked every
        ``DEATH_CHECK_SECONDS``)."""
        while not self.dead:
            await asyncio.sleep(DEATH_CHECK_SECONDS)

    def _running(self) -> AsyncLLM:
        if self._engine is None:
            raise EngineUnavailable("the AR engine is not running")
        return self._engine

    async def run(self, request: EngineRequest) -> AsyncGenerator[EngineEvent, None]:
        """The request's rows as they become final, then its ``FinishedEvent``; aborted if left early."""
        async with self.submitted(request) as events:
            async for event in events:
                yield event

    @contextlib.asynccontextmanager
    async def submitted(self, request: EngineRequest) -> AsyncGenerator[AsyncIterator[EngineEvent], None]:
        """``run``'s events, in two steps: entering returns once the engine holds the request, so that what
        the caller sets up next (the handoff's connection) overlaps the engine's work; leaving aborts the
        request if it is unfinished."""
        if self._engine is None:
            raise EngineUnavailable("the AR engine is not running")
        rows = (
            self._channel.open_queue(request.engine_request_id, self.settings.row_buffer_bytes)
            if self._channel is not None
            else None
        )
        async with self.idle_release.in_flight():
            run = _EngineRun(self._engine, request, capture=rows is not None)
            try:
                outputs = await run.submit()
            except BaseException:
                self._close_queue(request)
                raise
            task = asyncio.create_task(run.consume(outputs), name=f"engine-{request.engine_request_id}")
            events = self._merge(run, task, rows, request)
            try:
                yield events
            finally:
                await events.aclose()
                if not task.done():
                    task.cancel()
                    await self._engine.abort(request.engine_request_id)
                await asyncio.gather(task, return_exceptions=True)
                self._close_queue(request)

    async def _return_free_pages(self) -> int:
        """What serving freed in the engine core back to the system, once idle (``services.heap``); the bytes
        that went back. Not this process's: it keeps little (benchmarks/results/memory_table.md), and while
        ``malloc_trim`` holds its heap the event loop waits on every allocation, the door's refusals too."""
        if not self._core_returns_pages or self._engine is None:
            return 0
        return sum(await self._engine.collective_rpc("return_free_pages"))

    def _close_queue(self, request: EngineRequest) -> None:
        if self._channel is not None:
            self._channel.close_queue(request.engine_request_id)

    async def _merge(
        self, run: _EngineRun, task: asyncio.Task[None], rows: RowQueue | None, request: EngineRequest
    ) -> AsyncGenerator[EngineEvent, None]:
        prompt = request.prompt_token_ids
        received = 0
        final_seen = rows is None
        while rows is not None and not final_seen:
            chunk = await self._next_rows(rows, task)
            if chunk.start != received:
                raise RuntimeError(f"{request.engine_request_id}: rows out of order ({chunk.start} != {received})")
            end = chunk.start + chunk.rows.shape[0]
            # A generated row needs its token id, which comes from the output channel.
            while len(prompt) + len(run.generated) < end and not task.done():
                await run.wait_for_tokens()
            if len(prompt) + len(run.generated) < end:
                await task  # raises if the engine failed
                raise RuntimeError(f"{request.engine_request_id}: rows past the known tokens ({end})")
            if chunk.rows.shape[0]:
                ids = (prompt + run.generated)[chunk.start : end]
                yield RowsEvent(start=chunk.start, rows=chunk.rows, token_ids=ids)
            received = end
            final_seen = chunk.final
        await task
        final = run.final
        if final is None:
            raise RuntimeError(f"{request.engine_request_id}: engine finished without a final output")
        returned = final.kv_transfer_params or {}
        expected = returned.get(ROW_COUNT_KEY) if rows is not None else None
        if expected is not None and expected != received:
            raise RuntimeError(f"{request.engine_request_id}: {received} rows received, engine reports {expected}")
        yield FinishedEvent(
            token_ids=prompt + run.generated,
            prompt_tokens=len(prompt),
            generated_token_ids=list(run.generated),
            row_count=received,
            cached_tokens=final.num_cached_tokens or 0,
            cache_creation_tokens=final.num_cache_creation_tokens or 0,
            submitted_at=run.submitted_at,
            first_token_at=run.first_token_at or run.finished_at,
            finished_at=run.finished_at,
            pictures_encoded=int(returned.get(PICTURES_ENCODED_KEY, 0)),
        )

    async def _next_rows(self, rows: RowQueue, task: asyncio.Task[None]) -> RowChunk:
        """The next row chunk; fails fast if the engine request fails meanwhile."""
        getter = asyncio.ensure_future(rows.next(self.settings.row_timeout_seconds))
        try:
            while True:
                failure = task.exception() if task.done() else None
                if failure is not None:
                    raise failure
                waiting = {getter} if task.done() else {getter, task}
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    return getter.result()
        finally:
            getter.cancel()


class _EngineRun:
    """Consumes one request's RequestOutputs (token ids and counts) alongside the rows."""

    def __init__(self, engine: AsyncLLM, request: EngineRequest, capture: bool) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._engine = engine
        self.request = request
        self.params = SamplingParams(
            max_tokens=request.max_new_tokens,
            temperature=request.temperature,
            seed=request.seed,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"kv_transfer_params": {ROW_QUEUE_KEY: request.engine_request_id}} if capture else None,
        )
        self.generated: list[int] = []
        self.final: RequestOutput | None = None
        self._tokens = asyncio.Event()
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at = 0.0

    async def submit(self) -> RequestOutputCollector:
        """Adds the request to the engine; returns its outputs' queue once the engine core has it."""
        request = self.request
        prompt: TokensPrompt = {"prompt_token_ids": request.engine_token_ids or request.prompt_token_ids}
        if request.pictures:
            prompt["multi_modal_data"] = {"image": list(request.pictures)}
        if self.request.cache_salt:
            prompt["cache_salt"] = self.request.cache_salt
        # vLLM warns about every trace context it gets while its tracing is off.
        traced = self._engine.observability_config.otlp_traces_endpoint is not None
        traceparent = current_traceparent() if traced else None
        trace_headers = {"traceparent": traceparent} if traceparent else None
        self.submitted_at = time.perf_counter()
        try:
            return await self._engine.add_request(
                self.request.engine_request_id, prompt, self.params, trace_headers=trace_headers
            )
        except EngineDeadError as exc:
            raise EngineUnavailable("the AR engine died") from exc

    async def consume(self, outputs: RequestOutputCollector) -> None:
        """Reads the request's outputs until the last, as ``AsyncLLM.generate`` does after adding it."""
        try:
            while self.final is None:
                output = cast("RequestOutput", outputs.get_nowait() or await outputs.get())
                self._check_expanded(output)
                new = output.outputs[0].token_ids if output.outputs else []
                if new and self.first_token_at is None:
                    self.first_token_at = time.perf_counter()
                self.generated.extend(new)
                if output.finished:
                    self.final = output
                self._tokens.set()
        except EngineDeadError as exc:
            raise EngineUnavailable("the AR engine died") from exc
        finally:
            self.finished_at = time.perf_counter()
            self._tokens.set()

    def _check_expanded(self, output: RequestOutput) -> None:
        """Rows are tagged with the prompt ids the AR expanded; vLLM's own expansion must be the same."""
        expanded = output.prompt_token_ids
        if self.request.pictures and expanded is not None and list(expanded) != self.request.prompt_token_ids:
            raise RuntimeError(
                f"{self.request.engine_request_id}: the engine expanded the pictures to {len(expanded)} prompt "
                f"tokens, the AR to {len(self.request.prompt_token_ids)}"
            )

    async def wait_for_tokens(self) -> None:
        await self._tokens.wait()
        self._tokens.clear()


def _kv_bytes_per_token(config: VllmConfig, dtype: torch.dtype, captured_layers: int) -> int:
    """What one token takes in the KV cache: its keys and values in every layer, and its captured layers' rows."""
    model, parallel = config.model_config, config.parallel_config
    keys_and_values = 2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel) * model.get_head_size()
    return (keys_and_values + captured_layers * model.get_hidden_size()) * dtype.itemsize
