"""Whether the AR can serve: its engine is up and warmed, and a DiT replica is ready and compatible.

One place answers both ``/readyz`` and the check every request makes before any work; the DiTs'
announced capabilities and capacity come with a ready answer, so a request is validated against
the limits of the DiTs it may go to and admitted against their room.
"""

from __future__ import annotations

from dataclasses import dataclass

from ar_service.dit_pool import DitPool
from services.app import Readiness
from services.errors import ApiError
from shared.capabilities import DitCapabilities

# What a client is told to wait before retrying while something is starting.
NOT_READY_RETRY_AFTER = "5"


@dataclass
class ArReadiness:
    dits: DitPool
    engine_ready: bool = False
    engine_error: str | None = None

    async def probe(self) -> Readiness:
        if self.engine_error:
            return Readiness(False, f"engine failed: {self.engine_error}")
        if not self.engine_ready:
            return Readiness(False, "engine loading")
        state = await self.dits.state()
        return Readiness(state.ready, state.reason)

    async def capabilities(self) -> DitCapabilities | None:
        """What the ready DiTs announced together (None: none is ready)."""
        return (await self.dits.state()).capabilities

    def known(self) -> tuple[DitCapabilities, int] | None:
        """What ``require`` would answer, as last seen, without asking anyone; None while the pair is not known to
        be ready."""
        state = self.dits.known()
        if not (self.engine_ready and not self.engine_error and state.ready and state.capabilities is not None):
            return None
        return (state.capabilities, state.capacity) if state.capacity > 0 else None

    async def require(self) -> tuple[DitCapabilities, int]:
        """What the ready DiTs can do and how many handoffs they hold; a 503 ``not_ready`` otherwise."""
        readiness = await self.probe()
        state = await self.dits.state()
        if not readiness.ready or state.capabilities is None:
            raise ApiError(
                503,
                f"service not ready: {readiness.reason}",
                code="not_ready",
                headers={"Retry-After": NOT_READY_RETRY_AFTER},
            )
        return state.capabilities, state.capacity
