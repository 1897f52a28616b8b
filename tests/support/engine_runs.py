"""Stand-in engine runs for unit tests of what sends them: ``submitted(events)`` is what
``HiddenStateEngine.submitted`` gives, entered at once, and leaving it closes ``events`` as leaving the
engine's aborts its request."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

from ar_service.engine.hidden_state_engine import EngineEvent


@contextlib.asynccontextmanager
async def submitted(events: AsyncGenerator[EngineEvent, None]) -> AsyncGenerator[AsyncIterator[EngineEvent], None]:
    try:
        yield events
    finally:
        await events.aclose()
