"""What the AR knows about its DiT: whether it is ready, and what it announced it can do.

The DiT's ``/readyz`` body carries its capabilities (``shared.capabilities``). They are read
again on every probe, so a DiT that restarts with other limits (or another model) is seen as
soon as it is ready again. A DiT whose rows would not fit this AR (another hidden size, an
unknown conditioning adapter) is reported not ready, with the reason, rather than failing every
request later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
from pydantic import ValidationError

from shared.capabilities import DitCapabilities

# The DiT's readiness is asked at most this often; probes and requests come more often.
RECHECK_SECONDS = 2.0


@dataclass(frozen=True)
class PeerState:
    ready: bool
    reason: str
    capabilities: DitCapabilities | None = None


class DitPeer:
    def __init__(self, client: httpx.AsyncClient, *, hidden_size: int, conditioning: str) -> None:
        """``client`` carries the DiT's base URL; the caller owns its lifetime."""
        self._client = client
        self._hidden_size = hidden_size
        self._conditioning = conditioning
        self._state = PeerState(False, "DiT not probed yet")
        self._checked_at = float("-inf")

    async def state(self) -> PeerState:
        """The DiT's state, probed again when the last probe is older than ``RECHECK_SECONDS``."""
        now = time.monotonic()
        if now - self._checked_at > RECHECK_SECONDS:
            self._state = await self._probe()
            self._checked_at = now
        return self._state

    @property
    def last(self) -> PeerState:
        """The state the last probe found (no new probe)."""
        return self._state

    def forget(self) -> None:
        """A request just found the DiT unavailable: probe again before the next one trusts it."""
        self._checked_at = float("-inf")

    async def _probe(self) -> PeerState:
        try:
            response = await self._client.get("/readyz", timeout=2.0)
        except httpx.HTTPError:
            return PeerState(False, "DiT service unreachable")
        if response.status_code != 200:
            return PeerState(False, "DiT service not ready")
        try:
            capabilities = DitCapabilities.model_validate(response.json()["capabilities"])
        except (ValueError, KeyError, TypeError, ValidationError):
            return PeerState(False, "DiT service announced no usable capabilities")
        if capabilities.hidden_size != self._hidden_size:
            return PeerState(
                False, f"DiT is conditioned on {capabilities.hidden_size}-wide rows, this AR makes {self._hidden_size}"
            )
        if self._conditioning not in capabilities.conditioning:
            return PeerState(False, f"DiT has no {self._conditioning!r} conditioning adapter")
        return PeerState(True, "ready", capabilities)
