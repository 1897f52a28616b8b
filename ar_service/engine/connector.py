"""ardit's vLLM KV connector: streams every request's hidden rows out of the engine, per step.

vLLM's ``extract_hidden_states`` speculative method runs a cache-only "draft" layer that writes the
captured hidden state of each scheduled token into the paged KV cache, in the same blocks (and
block ids) as the attention KV. Those blocks are hashed and prefix-cached like any other, so a
prefix hit brings the hidden rows back with the KV: reading a cached block *is* the
reconstruction. This connector only reads; it never loads anything into the cache.

Loaded by vLLM from ``kv_transfer_config`` (``kv_connector_module_path``); no fork. One vLLM method
is wrapped, by the worker role only (see below). It runs in two roles that meet only through the
per-step metadata (both in the EngineCore process at one device; a multi-device engine runs the
worker role in its worker processes):

- scheduler side: each step, for every scheduled request, decide which rows
  are final after this step — ``[sent, num_computed + scheduled - spec)`` — and ship their cache
  slots in the metadata. On the first step that range starts at 0 and so includes the rows of
  prefix-cache hits. When a request finishes, its remaining rows are shipped one step later
  with ``final`` set, and its blocks are held until the worker has read them.
- worker side (model process): after the step's draft write (``wait_for_save``) gather those
  slots, apply the final norm if configured, and push them to the AR service (``RowSender``).
  On CUDA the device→host copy runs on a side stream and a sender thread waits for it, so the
  engine step does not block on the copy.

Decode steps carry one token per request: the worker side installs ``draft_free``, which stops the
capture's proposer from scheduling a duplicate draft token (``kv_connector_extra_config["without_draft"]``).

Per-request options arrive in ``SamplingParams.extra_args["kv_transfer_params"]``:
``{"ardit_row_queue": <engine request id>}`` names the ``RowQueue`` its rows go to. Requests
without it are ignored (plain generation).

Both processes take a parent-death signal here, the one hook of ardit's that vLLM runs in each: the
AR that started the engine may be SIGKILLed, and vLLM's own shutdown runs only when the AR exits
cleanly. An AR killed while the engine starts (model load, before this hook) leaves it running until
it gets here, then it exits.
"""

from __future__ import annotations

import multiprocessing
import queue
import signal
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from ar_service.engine import draft_free
from ar_service.engine.final_norm import FinalNorm
from ar_service.engine.row_channel import RowSender
from services.lifetime import die_with_parent

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

ROW_QUEUE_KEY = "ardit_row_queue"
# Returned to the AR service in RequestOutput.kv_transfer_params on the final output.
ROW_COUNT_KEY = "ardit_rows"


@dataclass
class RowRead:
    """Rows ``[start, start + len(slots))`` of one request, at these cache slots."""

    row_queue: str
    start: int
    slots: list[int]
    final: bool = False
    req_id: str | None = None  # vLLM's id, for finished requests whose blocks we hold


@dataclass
class RowReadMetadata(KVConnectorMetadata):
    reads: list[RowRead] = field(default_factory=list)  # read in wait_for_save (this step's rows)
    finishing: list[RowRead] = field(default_factory=list)  # read in get_finished (finished requests)


@dataclass
class _Tracked:
    request: Request
    row_queue: str
    sent: int = 0  # rows [0, sent) have been shipped for reading


class HiddenStateConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        if kv_cache_config is None:
            raise ValueError("HiddenStateConnector needs the KV cache config (vLLM passes it to both roles)")
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        parent = multiprocessing.parent_process()
        if parent is not None:
            # EngineCore dies with the AR (a worker process, where there is one, with EngineCore), also when
            # the parent died while the engine was still starting. SIGKILL: nobody is left to read what they would
            # finish, and a stuck step would not see a SIGTERM.
            die_with_parent(signal.SIGKILL, parent.pid)
        transfer = vllm_config.kv_transfer_config
        extra = (transfer.kv_connector_extra_config if transfer is not None else None) or {}
        # HiddenStateEngine sets every key from ArSettings, the one home of their defaults.
        missing = sorted({"rows_endpoint", "final_norm", "without_draft"} - extra.keys())
        if missing:
            raise ValueError(f"HiddenStateConnector needs kv_connector_extra_config keys {missing}")
        self._endpoint: str = extra["rows_endpoint"]
        self._apply_final_norm: bool = bool(extra["final_norm"])
        self._group, self._block_size = _hidden_state_group(kv_cache_config)
        if role == KVConnectorRole.WORKER:
            if extra["without_draft"]:
                draft_free.install()  # before the first step: the proposer runs in this process
            elif draft_free.installed():
                # An earlier engine in this process wrapped the proposer for good: this one would
                # run draft-free too and measure the wrong thing.
                raise RuntimeError("capture_without_draft is off, but this process already runs draft-free")
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._finishing: list[RowRead] = []
        # worker side
        self._kv: torch.Tensor | None = None
        self._norm: FinalNorm | None = None
        self._sender: RowSender | None = None
        self._async_copy: _DeviceToHostSender | None = None

    # ---- scheduler side ------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False  # nothing is loaded from outside; prefix hits are vLLM's own

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        row_queue = (request.kv_transfer_params or {}).get(ROW_QUEUE_KEY)
        if row_queue is None:
            return
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            self._tracked[request.request_id] = _Tracked(request, row_queue)
        else:  # resumed after preemption: rows already sent stay sent
            tracked.request = request

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = RowReadMetadata(finishing=self._finishing)
        self._finishing = []
        block_state = scheduler_output.kv_connector_block_state
        if block_state is None:
            raise RuntimeError("vLLM gave the connector no block state for this step")
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            # num_computed_tokens is still this step's start (already corrected for rejected
            # drafts); the draft position written this step is final only once accepted, so it
            # is picked up next step (or at finish).
            spec = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
            end = tracked.request.num_computed_tokens + scheduled - spec
            if end > tracked.sent:
                block_ids = block_state.get_block_ids(req_id)
                if block_ids is None:
                    raise RuntimeError(f"no blocks for {req_id}")
                blocks = block_ids[self._group]
                meta.reads.append(RowRead(tracked.row_queue, tracked.sent, self._slots(blocks, tracked.sent, end)))
                tracked.sent = end
        return meta

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        # The last sampled token was never an input, so it has no row; an accepted final draft
        # can leave one in the cache, which is not part of the contract.
        end = max(tracked.sent, min(request.num_computed_tokens, request.num_tokens - 1))
        slots = self._slots(block_ids[self._group], tracked.sent, end) if block_ids[self._group] else []
        self._finishing.append(RowRead(tracked.row_queue, tracked.sent, slots, final=True, req_id=request.request_id))
        # Hold the blocks until the worker has read the last rows (it reports the id as sent).
        return True, {ROW_COUNT_KEY: end}

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def _slots(self, blocks: list[int], start: int, end: int) -> list[int]:
        size = self._block_size
        return [blocks[p // size] * size + p % size for p in range(start, end)]

    # ---- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        layers = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(layers) != 1:
            raise RuntimeError(f"expected one cache-only hidden-state layer, found {layers}")
        # [num_blocks, num_captured_layers, block_size, hidden]; one captured layer here.
        self._kv = kv_caches[layers[0]]
        if self._kv.shape[2] != self._block_size:
            raise RuntimeError(
                f"hidden-state cache blocks hold {self._kv.shape[2]} tokens, its KV cache group says {self._block_size}"
            )
        if self._apply_final_norm:
            model = self._vllm_config.model_config
            norm = FinalNorm.from_checkpoint(model.model, eps=model.hf_text_config.rms_norm_eps)
            self._norm = norm.to(self._kv.device)
        self._sender = RowSender(self._endpoint)
        if self._kv.is_cuda:
            self._async_copy = _DeviceToHostSender(self._sender)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        # Runs after this step's draft write on both model runners: the rows are in the cache.
        for read in self._metadata().reads:
            self._push(read)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Only finished requests' rows are read here: on the V1 runner this hook runs before the
        # step's draft write, and finished requests are no longer written.
        done: set[str] = set()
        for read in self._metadata().finishing:
            self._push(read)
            if read.req_id is not None:
                done.add(read.req_id)
        # Reporting them as sent lets the scheduler free the blocks we held.
        return (done or None), None

    def _metadata(self) -> RowReadMetadata:
        """This step's reads (none before the first step's metadata arrives)."""
        if not self.has_connector_metadata():
            return RowReadMetadata()
        meta = self._get_connector_metadata()
        if not isinstance(meta, RowReadMetadata):
            raise TypeError(f"unexpected connector metadata {type(meta).__name__}")
        return meta

    def _push(self, read: RowRead) -> None:
        if self._kv is None or self._sender is None:
            raise RuntimeError("rows to read before register_kv_caches")
        if read.slots:
            slots = torch.tensor(read.slots, dtype=torch.long, device=self._kv.device)
            rows = self._kv[slots // self._block_size, 0, slots % self._block_size]  # gathered copy
            if self._norm is not None:
                rows = self._norm(rows)
        else:
            rows = self._kv.new_empty((0, self._kv.shape[-1]))
        if self._async_copy is not None:
            self._async_copy.submit(read, rows)
        else:
            self._sender.send(read.row_queue, read.start, rows, read.final)

    def get_finished_count(self) -> int | None:
        return 1  # the hidden-state layer is not sharded: one worker reports and sends

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None  # with one captured layer every layout keeps a token's row contiguous

    def shutdown(self) -> None:
        if self._async_copy is not None:
            self._async_copy.close()
        if self._sender is not None:
            self._sender.close()


class _DeviceToHostSender:
    """CUDA only: copy rows to pinned host memory on a side stream; a thread sends when ready."""

    def __init__(self, sender: RowSender) -> None:
        self._sender = sender
        self._stream = torch.cuda.Stream()
        self._queue: queue.Queue[tuple[RowRead, torch.Tensor, torch.cuda.Event] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ardit-rows-d2h", daemon=True)
        self._thread.start()

    def submit(self, read: RowRead, rows: torch.Tensor) -> None:
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        rows.record_stream(self._stream)  # keep the device gather alive until the copy is done
        self._queue.put((read, host, event))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            read, host, event = item
            event.synchronize()
            self._sender.send(read.row_queue, read.start, host, read.final)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)


def _hidden_state_group(kv_cache_config: KVCacheConfig) -> tuple[int, int]:
    """Index and block size of the KV cache group that holds the hidden-state cache layer.

    Found by its spec type (``HiddenStateCacheSpec``), not by layer name. Hybrid models give the
    cache-only layer a group of its own. Uniform models have one group shared with attention: the
    worker sees it as a ``UniformTypeKVCacheSpecs`` holding the hidden-state spec, the scheduler as
    one arbitrary layer's spec (vLLM's ``generate_scheduler_kv_cache_config``), so a lone group is
    the one.
    """
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec, UniformTypeKVCacheSpecs

    groups = kv_cache_config.kv_cache_groups
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        specs = spec.kv_cache_specs.values() if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
        if any(isinstance(s, HiddenStateCacheSpec) for s in specs):
            return index, spec.block_size
    if len(groups) == 1:
        return 0, groups[0].kv_cache_spec.block_size
    raise ValueError("HiddenStateConnector needs speculative_config method 'extract_hidden_states'")
