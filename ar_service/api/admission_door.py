"""The image routes' door: the AR's outermost ASGI layer, where every image request takes its admission place
as it arrives, before any other layer, routing or body parsing runs for it.

- A request the line has no room for is answered 429 here, with ``Retry-After`` and a request id, counted
  (``http_requests``, ``api_errors``) and logged together with the others refused within a second; a client that
  sent ``Expect: 100-continue`` is refused with ``Connection: close``.
- A request that arrives before the pair is known to be ready waits for the readiness probe here, and is answered
  503 ``not_ready`` if the pair is not. Serving never admits.
- A burst is answered before the work it admits: an admitted request goes on once ``QUIET_PASSES`` loop passes in
  a row brought no image request to the door, or once ``BURST_ARRIVALS`` image requests reached it after its own;
  admitted requests go on one at a time, each after a pass.
- What the door cannot decide alone (a request without a valid API key, one that arrives while the service
  drains, one on the internal port) goes on to the layers behind, which answer it (401, 503, 404).
- An admitted request's place travels in its ASGI state (``take_place``); from then serving owns it. A request
  that never reaches serving gives its place back when its ASGI call ends.

Why these rules, and what they cost: docs/api.md ("Admission").
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
# Loop passes in a row without an image request at the door after which admitted work goes on: more than the
# passes between a request's bytes reaching the server and its door (the read, then its task; before the read, a
# pipelined request's connection resumes reading). Passes, not seconds: a busy machine's pause between two passes
# brings no arrival that a pass would not.
QUIET_PASSES = 4
# Image requests after an admitted one past which its work goes on however the door is: a burst this long is
# answered first, a flood that never pauses still lets admitted work through.
BURST_ARRIVALS = 1024


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
        self._refused_unlogged = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        decides, tenant = self._decides(scope)
        if not decides:
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        entered = self.enter(tenant)
        if entered is None:  # the pair is not known to be ready: ask, once for all who arrive meanwhile
            entered = await self._enter_once_ready(tenant)
        if isinstance(entered, ApiError):
            await self._refuse(entered, scope, send, started)
            return
        arrival, state = self._arrivals, scope.setdefault("state", {})
        state[_PLACE] = entered
        try:
            # Refusals are answered as their requests arrive; admitted work waits for its burst to be answered.
            async with self._one_at_a_time:
                await self._burst_answered(arrival)
            await self.app(scope, receive, send)
        finally:
            if state.pop(_PLACE, None) is entered:
                entered.leave()

    @property
    def arrivals(self) -> int:
        """Image requests the door has decided on so far; the last one's number."""
        return self._arrivals

    def enter(self, tenant: str | None) -> AdmissionPlace | ApiError | None:
        """The place of a request from ``tenant``'s key (a slot, or a place in line), priced as the DiTs' default
        request or, lighter, as recent requests asked (``RequestAdmission.unread_load``) until serving has read what
        it asks; the refusal when the line has no room for it; None while the pair is not known to be ready."""
        known = self._readiness.known()
        if known is None:
            return None
        return self._entered(*known, tenant)

    async def _enter_once_ready(self, tenant: str | None) -> AdmissionPlace | ApiError:
        try:
            dits, capacity = await self._readiness.require()
        except ApiError as not_ready:
            return not_ready
        return self._entered(dits, capacity, tenant)

    def _entered(self, dits: DitCapabilities, capacity: int, tenant: str | None) -> AdmissionPlace | ApiError:
        self._arrivals += 1
        try:
            unread = self._admission.unread_load(Load.of(dits.default_params()))
            return self._admission.enter(capacity, unread, dits.pace, tenant)
        except ApiError as refused:
            return refused

    async def _burst_answered(self, arrival: int) -> None:
        """Returns after ``QUIET_PASSES`` loop passes in a row that brought no image request to the door, or once
        ``BURST_ARRIVALS`` of them came after ``arrival``, the request's own number."""
        quiet, seen = 0, self._arrivals
        while quiet < QUIET_PASSES and self._arrivals - arrival < BURST_ARRIVALS:
            await asyncio.sleep(0)
            quiet = quiet + 1 if self._arrivals == seen else 0
            seen = self._arrivals

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

    def _decides(self, scope: Scope) -> tuple[bool, str | None]:
        """Whether the door decides on the request, and whose API key sent it (None without keys)."""
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self._paths:
            return False, None
        server = scope.get("server")
        on_internal_port = self._internal_port is not None and server is not None and server[1] == self._internal_port
        if self._drain.started or on_internal_port:
            return False, None
        if not self._auth.enabled:
            return True, None
        try:
            return True, self._auth.check(header(scope, b"authorization"))
        except ApiError:
            return False, None

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
