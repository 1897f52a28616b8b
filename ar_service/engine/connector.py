"""ardit's vLLM KV connector: streams every request's hidden rows out of the engine, per step.

vLLM's ``extract_hidden_states`` speculative method runs a cache-only "draft" layer that writes the
captured hidden state of each scheduled token into the paged KV cache, in the same blocks (and
block ids) as the attention KV. Those blocks are hashed and prefix-cached like any other, so a
prefix hit brings the hidden rows back with the KV: reading a cached block *is* the
reconstruction. This connector only reads; it never loads anything into the cache.

Loaded by vLLM from ``kv_transfer_config`` (``kv_connector_module_path``); no fork. One vLLM method
is wrapped, by the worker role only (see below). vLLM makes one instance per role, which meet only
through the per-step metadata (``row_reads``); as vLLM's own connectors do, this class only hands each
of vLLM's calls to its role's object (both in the EngineCore process at one device; a multi-device
engine runs the worker role in its worker processes):

- scheduler role (``row_scheduler.RowScheduler``): which rows of each request are final after this
  step, and their cache slots; a finished request's last rows, its blocks held until they are read.
- worker role (``row_reader.RowReader``, the model's process): after the step's draft write
  (``wait_for_save``), gather those slots, apply the final norm, and push them to the AR service.

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
import signal
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from ar_service.engine import draft_free
from ar_service.engine.row_reader import RowReader
from ar_service.engine.row_reads import RowReadMetadata
from ar_service.engine.row_scheduler import PICTURES_ENCODED_KEY, ROW_COUNT_KEY, ROW_QUEUE_KEY, RowScheduler
from services.lifetime import die_with_parent

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["PICTURES_ENCODED_KEY", "ROW_COUNT_KEY", "ROW_QUEUE_KEY", "HiddenStateConnector"]


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
        group, block_size = _hidden_state_group(kv_cache_config)
        self._scheduler: RowScheduler | None = None
        self._worker: RowReader | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = RowScheduler(group, block_size)
            return
        if extra["without_draft"]:
            draft_free.install()  # before the first step: the proposer runs in this process
        elif draft_free.installed():
            # An earlier engine in this process wrapped the proposer for good: this one would
            # run draft-free too and measure the wrong thing.
            raise RuntimeError("capture_without_draft is off, but this process already runs draft-free")
        self._worker = RowReader(vllm_config, extra["rows_endpoint"], bool(extra["final_norm"]), block_size)

    def _scheduler_role(self) -> RowScheduler:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side call on the worker role's connector")
        return self._scheduler

    def _worker_role(self) -> RowReader:
        if self._worker is None:
            raise RuntimeError("a worker-side call on the scheduler role's connector")
        return self._worker

    # ---- scheduler role ------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False  # nothing is loaded from outside; prefix hits are vLLM's own

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler_role().allocated(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_role().metadata(scheduler_output)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_role().finished(request, block_ids)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    # ---- worker role ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_role().register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        # Runs after this step's draft write on both model runners: the rows are in the cache.
        worker = self._worker_role()
        for read in self._metadata().reads:
            worker.push(read)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Only finished requests' rows are read here: on the V1 runner this hook runs before the
        # step's draft write, and finished requests are no longer written.
        worker, done = self._worker_role(), set()
        for read in self._metadata().finishing:
            worker.push(read)
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

    def get_finished_count(self) -> int | None:
        return 1  # the hidden-state layer is not sharded: one worker reports and sends

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None  # rows are gathered by their logical index (block, layer, slot), whatever the layout

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()


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
