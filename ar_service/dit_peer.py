"""What the AR knows about its DiT: whether it is ready, and what it announced it can do.

The DiT's ``/readyz`` body carries its capabilities (``shared.capabilities``). They are read
again on every probe, so a DiT that restarts with other limits (or another model) is seen as
soon as it is ready again. A DiT whose rows would not fit this AR (another width, rows read otherwise
than its model card says this AR reads them, an unknown conditioning adapter) is reported not ready,
with the reason, rather than failing every request later.

A request never waits on a routine probe: one probe at a time refreshes a state older than
``RECHECK_SECONDS`` while requests go on with the last one (a burst of hundreds of requests used to
send hundreds of probes to a DiT busy rendering, and every one of them, refusals included, waited
for its answer). Only a state not trusted yet — before the first probe, or after a request found
the DiT unavailable — is waited for, and then all callers share the one probe.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import aiohttp
from pydantic import ValidationError

from shared.capabilities import DitCapabilities
from shared.row_recipe import RowRecipe

log = logging.getLogger("ardit.ar.dit_peer")

# The DiT's readiness is asked at most this often; probes and requests come more often.
RECHECK_SECONDS = 2.0
# A DiT that has not answered its readiness probe within this is not ready.
PROBE_TIMEOUT_SECONDS = 2.0


@dataclass(frozen=True)
class PeerState:
    ready: bool
    reason: str
    capabilities: DitCapabilities | None = None


class DitPeer:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, *, rows: RowRecipe, row_width: int) -> None:
        """The caller owns ``session``'s lifetime. ``rows``: how this AR reads the rows it streams, ``row_width``
        wide."""
        self._session = session
        self._readyz = f"{base_url}/readyz"
        self._rows = rows
        self._row_width = row_width
        self._state = PeerState(False, "DiT not probed yet")
        self._checked_at = float("-inf")
        self._trusted = False
        self._probing: asyncio.Task[PeerState] | None = None

    async def state(self) -> PeerState:
        """The DiT's state: the last one while it is trusted (a probe refreshes it in the background when
        it is older than ``RECHECK_SECONDS``), else the answer of the probe under way."""
        if self._probing is None and time.monotonic() - self._checked_at > RECHECK_SECONDS:
            self._probing = asyncio.create_task(self._refresh())
        if self._trusted or self._probing is None:
            return self._state
        # Shielded: a caller that is cancelled (its client left) does not cancel the others' probe.
        return await asyncio.shield(self._probing)

    @property
    def last(self) -> PeerState:
        """The state the last probe found (no new probe)."""
        return self._state

    def forget(self) -> None:
        """A request just found the DiT unavailable: probe again before the next one trusts it."""
        self._checked_at = float("-inf")
        self._trusted = False

    async def _refresh(self) -> PeerState:
        try:
            state = await self._probe()
        except Exception as exc:  # a probe's own failure (say, its client closed under it) is "not ready"
            log.warning("probing the DiT failed: %r", exc)
            state = PeerState(False, f"probing the DiT failed: {exc!r}")
        finally:
            self._probing = None
        self._state, self._checked_at, self._trusted = state, time.monotonic(), True
        return state

    async def _probe(self) -> PeerState:
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_SECONDS), self._session.get(self._readyz) as response:
                status, answer = response.status, await response.read()
        except (aiohttp.ClientError, TimeoutError):
            return PeerState(False, "DiT service unreachable")
        if status != 200:
            return PeerState(False, "DiT service not ready")
        try:
            capabilities = DitCapabilities.model_validate(json.loads(answer)["capabilities"])
        except (ValueError, KeyError, TypeError, ValidationError):
            return PeerState(False, "DiT service announced no usable capabilities")
        if capabilities.row_width != self._row_width:
            return PeerState(
                False, f"DiT is conditioned on {capabilities.row_width}-wide rows, this AR makes {self._row_width}"
            )
        differences = capabilities.rows.differences(self._rows) if capabilities.rows is not None else {}
        if differences:
            return PeerState(False, f"DiT reads rows otherwise than this AR: {'; '.join(differences.values())}")
        if self._rows.conditioning not in capabilities.conditioning:
            return PeerState(False, f"DiT has no {self._rows.conditioning!r} conditioning adapter")
        return PeerState(True, "ready", capabilities)
