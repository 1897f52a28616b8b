"""The scheduler role of ardit's KV connector (``connector``): each step, for every scheduled request that
streams rows, which rows are final after this step — ``[sent, num_computed + scheduled - spec)`` — and their
cache slots. On the first step that range starts at 0 and so includes the rows of prefix-cache hits. When a
request finishes, its remaining rows are shipped one step later with ``final`` set, and its blocks are held
until the worker role has read them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ar_service.engine.row_reads import RowRead, RowReadMetadata

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

ROW_QUEUE_KEY = "ardit_row_queue"
# Returned to the AR service in RequestOutput.kv_transfer_params on the final output: the rows sent, and how many
# of its pictures the vision tower encoded (a picture whose embeddings vLLM's encoder cache held is not encoded).
ROW_COUNT_KEY = "ardit_rows"
PICTURES_ENCODED_KEY = "ardit_pictures_encoded"


@dataclass
class _Tracked:
    request: Request
    row_queue: str
    sent: int = 0  # rows [0, sent) have been shipped for reading
    pictures_encoded: int = 0


class RowScheduler:
    def __init__(self, group: int, block_size: int) -> None:
        """``group``: the KV cache group of the hidden-state layer, whose blocks of ``block_size`` hold the rows."""
        self._group = group
        self._block_size = block_size
        self._tracked: dict[str, _Tracked] = {}
        self._finishing: list[RowRead] = []

    def allocated(self, request: Request) -> None:
        row_queue = (request.kv_transfer_params or {}).get(ROW_QUEUE_KEY)
        if row_queue is None:
            return  # plain generation: no rows
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            self._tracked[request.request_id] = _Tracked(request, row_queue)
        else:  # resumed after preemption: rows already sent stay sent
            tracked.request = request

    def metadata(self, scheduler_output: SchedulerOutput) -> RowReadMetadata:
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
            tracked.pictures_encoded += len(scheduler_output.scheduled_encoder_inputs.get(req_id, ()))
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

    def finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        # The last sampled token was never an input, so it has no row; an accepted final draft
        # can leave one in the cache, which is not part of the contract.
        end = max(tracked.sent, min(request.num_computed_tokens, request.num_tokens - 1))
        slots = self._slots(block_ids[self._group], tracked.sent, end) if block_ids[self._group] else []
        self._finishing.append(RowRead(tracked.row_queue, tracked.sent, slots, final=True, req_id=request.request_id))
        # Hold the blocks until the worker has read the last rows (it reports the id as sent).
        return True, {ROW_COUNT_KEY: end, PICTURES_ENCODED_KEY: tracked.pictures_encoded}

    def _slots(self, blocks: list[int], start: int, end: int) -> list[int]:
        size = self._block_size
        return [blocks[p // size] * size + p % size for p in range(start, end)]
