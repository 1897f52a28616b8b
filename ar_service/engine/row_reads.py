"""What the two roles of ardit's KV connector (``connector``) say to each other each step: which rows of which
request to read, at which cache slots. The scheduler role writes it (``row_scheduler``), the worker role reads
it (``row_reader``); vLLM carries it as the step's connector metadata."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class RowRead:
    """Rows ``[start, start + len(slots))`` of one request, at these cache slots."""

    row_queue: str
    start: int
    slots: list[int]
    final: bool = False
    req_id: str | None = None  # vLLM's id, for finished requests whose blocks are held


@dataclass
class RowReadMetadata(KVConnectorMetadata):
    reads: list[RowRead] = field(default_factory=list)  # read in wait_for_save (this step's rows)
    finishing: list[RowRead] = field(default_factory=list)  # read in get_finished (finished requests)
