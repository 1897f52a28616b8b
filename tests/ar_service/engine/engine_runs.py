"""Run engine requests to completion and gather what they streamed."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import torch

from ar_service.engine.hidden_state_engine import EngineRequest, FinishedEvent, HiddenStateEngine, RowsEvent


@dataclass
class EngineRun:
    rows: torch.Tensor  # [n, hidden], rows placed by index
    row_token_ids: list[int]
    chunks: list[tuple[int, int]]  # (start, count) in arrival order
    finished: FinishedEvent


async def run_engine(
    engine: HiddenStateEngine, prompt_ids: list[int], max_new_tokens: int = 1, cache_salt: str | None = None
) -> EngineRun:
    request = EngineRequest(
        engine_request_id=f"test:{uuid.uuid4().hex[:12]}",
        prompt_token_ids=prompt_ids,
        max_new_tokens=max_new_tokens,
        cache_salt=cache_salt,
    )
    events: list[RowsEvent] = []
    finished = None
    async for event in engine.run(request):
        if isinstance(event, RowsEvent):
            events.append(event)
        else:
            finished = event
    assert finished is not None
    rows = torch.cat([e.rows for e in events]) if events else torch.empty(0, engine.row_width)
    return EngineRun(
        rows=rows,
        row_token_ids=[t for e in events for t in e.token_ids],
        chunks=[(e.start, e.rows.shape[0]) for e in events],
        finished=finished,
    )


def token_prompt(length: int, seed: int) -> list[int]:
    """``length`` ordinary token ids (no specials), different for every seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (length,), generator=generator).tolist()
