"""The image routes' door: the AR's outermost ASGI layer, where every image request takes its admission place
as it arrives, before any other layer, routing or body parsing runs for it.

A request the line has no room for is answered 429 here, with ``Retry-After`` and a request id: no span,
routing, body parsing, validation or tokenizing, so a burst of hundreds is answered fast
(``benchmarks/door_burst.py`` times it). It is plain ASGI, so it works under any ASGI server and in process,
and it is the one entrance: every image request that reaches serving holds the place it took here. A request
that arrives before the pair is known to be ready waits for the readiness probe here and is answered 503
``not_ready`` if the pair is not; serving never admits.

The work of the requests a burst admits waits until the burst is read (``BURST_QUIET_SECONDS``), and
admitted requests go on one at a time, each after a pass of the event loop, so a refusal waits behind at
most one admitted request's parsing, however a burst's bytes arrive. The door counts its refusals
(``http_requests`` and ``api_errors``, as the layers behind would have) and logs them together, at most one
line a second: in a burst, a line per refusal cost as much as the refusal itself. A client that sent
``Expect: 100-continue`` is refused with ``Connection: close``: its body never comes.

The door decides only what it can decide alone: a request without a valid API key, one that arrives while
the service drains, or one on the internal port goes on, and the layers behind answer it (401, 503, 404).

An admitted request's place travels in its ASGI state (``take_place``); from then serving owns it. A request
that never reaches serving (a body that does not parse, say) gives its place back when its ASGI call ends.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Iterable

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from ar_service.admission import AdmissionPlace, RequestAdmission
from ar_service.readiness import ArReadiness
from services.app_metrics import AppMetrics
from services.auth import BearerAuth
from services.drain import Drain
from services.errors import ApiError
from services.request_context import REQUEST_ID_HEADER, request_id_of
from services.request_gate import header
from shared.capabilities import DitCapabilities, Load

log = logging.getLogger("ardit.ar.admission_door")

_PLACE = "admission_place"

# How often a stream of refusals is logged (one line for all of them).
REFUSAL_LOG_SECONDS = 1.0
# A burst is answered before the work it admits: an admitted request's work waits until no image request has
# reached the door for BURST_QUIET_SECONDS, and BURST_HOLD_SECONDS at most, so a flood that never pauses
# still lets admitted work through, one request per hold.
BURST_QUIET_SECONDS = 0.001
BURST_HOLD_SECONDS = 0.01


class AdmissionDoor:
    def __init__(
        self,
        app: ASGIApp,
        *,
        admission: RequestAdmission,
        readiness: ArReadiness,
        paths: Iterable[str],
        auth: BearerAuth,
        drain: Drain,
        metrics: AppMetrics,
        internal_port: int | None,
    ) -> None:
        """``app``: the layers behind; ``paths``: the routes (POST) whose requests are admitted; ``auth``: the
        public API keys (the gate behind checks them again and answers a wrong one)."""
        self.app = app
        self._admission = admission
        self._readiness = readiness
        self._paths = frozenset(paths)
        self._auth = auth
        self._drain = drain
        self._metrics = metrics
        self._internal_port = internal_port
        self._one_at_a_time = asyncio.Lock()
        self._arrivals = 0  # image requests the door decided on
        self._last_arrival = float("-inf")
        self._refused_unlogged = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._decides(scope):
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        entered = self.enter(scope)
        if entered is None:  # the pair is not known to be ready: ask, once for all who arrive meanwhile
            entered = await self._enter_once_ready()
        if isinstance(entered, ApiError):
            await self._refuse(entered, scope, send, started)
            return
        arrival, state = self._arrivals, scope.setdefault("state", {})
        state[_PLACE] = entered
        try:
            # Refusals are answered as their requests arrive. Admitted requests go on to their work one at a
            # time, each after a pass, and after the burst it came in (or a hold).
            async with self._one_at_a_time:
                await asyncio.sleep(0)
                await self._burst_read(arrival)
            await self.app(scope, receive, send)
        finally:
            if state.pop(_PLACE, None) is entered:
                entered.leave()

    @property
    def arrivals(self) -> int:
        """Image requests the door has decided on so far; the last one's number."""
        return self._arrivals

    def enter(self, scope: Scope) -> AdmissionPlace | ApiError | None:
        """The request's place (a slot, or a place in line), priced as the DiTs' default request or, lighter, as
        recent requests asked (``RequestAdmission.unread_load``) until serving has read what it asks; the refusal
        when the line has no room for it; None while the pair is not known to be ready."""
        known = self._readiness.known()
        if known is None:
            return None
        return self._entered(*known)

    async def _enter_once_ready(self) -> AdmissionPlace | ApiError:
        try:
            dits, capacity = await self._readiness.require()
        except ApiError as not_ready:
            return not_ready
        return self._entered(dits, capacity)

    def _entered(self, dits: DitCapabilities, capacity: int) -> AdmissionPlace | ApiError:
        self._arrivals += 1
        self._last_arrival = time.monotonic()
        try:
            unread = self._admission.unread_load(Load.of(dits.default_params()))
            return self._admission.enter(capacity, unread, dits.pace)
        except ApiError as refused:
            return refused

    async def _burst_read(self, arrival: int) -> None:
        """Returns once no image request has arrived for ``BURST_QUIET_SECONDS`` after ``arrival``, or after
        ``BURST_HOLD_SECONDS``; at once for a request nobody came after."""
        held_until = time.monotonic() + BURST_HOLD_SECONDS
        while self._arrivals > arrival:
            now = time.monotonic()
            quiet_at = self._last_arrival + BURST_QUIET_SECONDS
            if now >= quiet_at or now >= held_until:
                return
            await asyncio.sleep(min(quiet_at, held_until) - now)

    async def _refuse(self, refused: ApiError, scope: Scope, send: Send, started: float) -> None:
        """``refused`` as the whole answer; the request's body, if any, is left for the server to drop."""
        own, body = _encoded(
            refused.status, refused.message, refused.type, refused.param, refused.code, tuple(refused.headers.items())
        )
        headers = [*own, (_REQUEST_ID, request_id_of(scope).encode())]
        if (header(scope, b"expect") or "").lower() == "100-continue":
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": refused.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        self._metrics.count_error(refused)
        self._metrics.observe_response(scope["path"], scope["method"], str(refused.status), time.monotonic() - started)
        self._log_refusal(refused)

    def _decides(self, scope: Scope) -> bool:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self._paths:
            return False
        server = scope.get("server")
        on_internal_port = self._internal_port is not None and server is not None and server[1] == self._internal_port
        if self._drain.started or on_internal_port:
            return False
        return not self._auth.enabled or self._auth.accepts(header(scope, b"authorization"))

    def _log_refusal(self, refused: ApiError) -> None:
        if self._refused_unlogged == 0:
            asyncio.get_running_loop().call_later(REFUSAL_LOG_SECONDS, self._log_refusals, refused.message)
        self._refused_unlogged += 1

    def _log_refusals(self, first: str) -> None:
        log.warning(
            "refused %d image request(s) at the door in %g s (the first: %s)",
            self._refused_unlogged,
            REFUSAL_LOG_SECONDS,
            first,
        )
        self._refused_unlogged = 0


_REQUEST_ID = REQUEST_ID_HEADER.encode()


@functools.lru_cache(maxsize=64)
def _encoded(
    status: int, message: str, type: str, param: str | None, code: str | None, headers: tuple[tuple[str, str], ...]
) -> tuple[tuple[tuple[bytes, bytes], ...], bytes]:
    """A refusal's own headers (its type, length and ``headers``) and its JSON body. A burst's refusals say one
    of a few things (the wait, the queue's length, when to retry), so each is encoded once."""
    body = json.dumps(
        ApiError(status, message, param=param, code=code, type=type).body(), ensure_ascii=False, separators=(",", ":")
    ).encode()
    lines = [("content-type", "application/json"), ("content-length", str(len(body))), *headers]
    return tuple((name.lower().encode(), value.encode()) for name, value in lines), body


def take_place(request: Request) -> AdmissionPlace:
    """The place the door gave this request, now the caller's to turn into a slot or to leave."""
    place: AdmissionPlace | None = request.scope.get("state", {}).pop(_PLACE, None)
    if place is None:
        raise RuntimeError("an image request reached serving without an admission place: the door admits every one")
    return place
