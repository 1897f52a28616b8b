"""The image routes' door: a request takes its admission place when it starts (once its head is
parsed; a pipelined one, once the request before it is answered), before any task, middleware or
body parsing exists for it.

The door sits in uvicorn's HTTP protocol (``protocol``; ``services.serve`` runs the AR with it, and an
app served any other way, an in-process ASGI test client say, has no door), at the point where
uvicorn picks the app for its own ``limit_concurrency`` 503s: the request's method, path and headers
are parsed and its ASGI task is about to start. A request the line has no room for is
answered 429 there, with ``Retry-After`` and a request id, written straight to its connection: no
task, span, routing, body parsing, validation or tokenizing, so a burst of hundreds is answered
within one pass over it. The work of the requests a burst admits waits until the burst is read
(``BURST_QUIET_SECONDS``). On a 2-core host, on a day it ran at half its usual speed, the slowest
refusal of a burst of 522 came after 76 ms, against 130 ms for the same answer from the app's
outermost ASGI layer and 101 ms for this door before its refusals were made cheaper
(``benchmarks/door_burst.py``). The connection is kept or closed as uvicorn would for the same
answer (``refuse`` says where it differs); a body that follows is read and dropped.

The door counts its refusals (``http_requests`` and ``api_errors``, as the layers behind would have)
and logs them together, at most one line a second: in a burst, an access-log line per refusal cost
as much as the refusal itself. The request id each refusal carries is the caller's ``x-request-id``
when it sent a valid one.

The door decides only what it can decide alone: a request without a valid API key, one that
arrives while the service drains, one on the internal port, or any before the pair is known to be
ready goes on, and the layers behind answer it (401, 503, 404) — serving admits those it serves
itself.

An admitted request's place travels in its ASGI state (``take_place``); from then serving owns it. A
request that never reaches serving (a body that does not parse, say) gives its place back when its
ASGI call ends.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Iterable
from typing import cast

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from ar_service.admission import AdmissionPlace, RequestAdmission
from ar_service.readiness import ArReadiness
from services.app_metrics import AppMetrics
from services.auth import BearerAuth
from services.drain import Drain
from services.errors import ApiError
from services.request_context import REQUEST_ID_HEADER, request_id_of
from services.request_gate import header

log = logging.getLogger("ardit.ar.admission_door")

_PLACE = "admission_place"

# How often a stream of refusals is logged (one line for all of them).
REFUSAL_LOG_SECONDS = 1.0
# A burst is answered before the work it admits. An admitted request's work (parsing, validation,
# tokenizing: about half a millisecond on a 2-core host, four times a refusal) waits until no image
# request has reached the door for BURST_QUIET_SECONDS, and BURST_HOLD_SECONDS at most, so a flood that
# never pauses still lets admitted work through, one request per hold.
BURST_QUIET_SECONDS = 0.001
BURST_HOLD_SECONDS = 0.01


class AdmissionDoor:
    def __init__(
        self,
        *,
        admission: RequestAdmission,
        readiness: ArReadiness,
        paths: Iterable[str],
        auth: BearerAuth,
        drain: Drain,
        metrics: AppMetrics,
        internal_port: int | None,
    ) -> None:
        """``paths``: the routes (POST) whose requests are admitted; ``auth``: the public API keys (the
        gate behind checks them again and answers a wrong one)."""
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

    def protocol(self, base: type[HttpToolsProtocol]) -> type[HttpToolsProtocol]:
        """``base`` (uvicorn's httptools protocol, or a subclass) with the door before each request's task."""
        door = self

        class WithDoor(base):  # type: ignore[valid-type,misc]
            _completing_refusals = False
            _refused_again = False

            def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGIApp) -> None:
                # Every request starts here (from its parsed head, or queued behind a pipelined one). It
                # is not idle time: a refusal just before it, in the same bytes, armed the keep-alive timer.
                self._unset_keepalive_if_required()
                if self.transport.is_closing():
                    return  # a refusal closed it: uvicorn never starts a request on a closing connection
                scope = cast(Scope, cycle.scope)  # uvicorn's HTTPScope: the dict the app gets as its Scope
                entered = door.enter(scope)
                if isinstance(entered, ApiError):
                    door.refuse(entered, cycle, scope)
                    self._refusal_complete()
                    return
                if entered is not None:
                    scope.setdefault("state", {})[_PLACE] = entered
                    app = functools.partial(door.go_on, app, door.arrivals)
                super()._start_asgi_task(cycle, app)

            def _refusal_complete(self) -> None:
                """uvicorn's end of a response (the next pipelined request starts, or the keep-alive timer),
                taken in turn for a run of pipelined refusals rather than one inside the other."""
                if self._completing_refusals:
                    self._refused_again = True
                    return
                self._completing_refusals = True
                try:
                    self._refused_again = True
                    while self._refused_again:
                        self._refused_again = False
                        self.on_response_complete()
                finally:
                    self._completing_refusals = False

        return WithDoor

    @property
    def arrivals(self) -> int:
        """Image requests the door has decided on so far; the last one's number."""
        return self._arrivals

    def enter(self, scope: Scope) -> AdmissionPlace | ApiError | None:
        """The request's place (a slot, or a place in line); the refusal when the line has no room for it;
        None when the door does not decide and the request goes on without a place."""
        capacity = self._readiness.known_capacity() if self._decides(scope) else None
        if capacity is None:
            return None
        self._arrivals += 1
        self._last_arrival = time.monotonic()
        try:
            return self._admission.enter(capacity)
        except ApiError as refused:
            return refused

    async def go_on(self, app: ASGIApp, arrival: int, scope: Scope, receive: Receive, send: Send) -> None:
        """An admitted request's ASGI call: ``app``, then its place back unless serving took it. ``arrival``:
        its number among the door's arrivals."""
        state = scope["state"]
        place = state[_PLACE]
        try:
            # Refusals are answered as their bytes are read, between loop passes. Admitted requests go on
            # to their work one at a time, each after a pass, and after the burst it came in (or a hold),
            # so a refusal waits behind at most one request's work, however a burst's bytes arrive.
            async with self._one_at_a_time:
                await asyncio.sleep(0)
                await self._burst_read(arrival)
            await app(scope, receive, send)
        finally:
            if state.pop(_PLACE, None) is place:
                place.leave()

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

    def refuse(self, refused: ApiError, cycle: RequestResponseCycle, scope: Scope) -> None:
        """``refused`` written as the whole answer of ``cycle``'s request (``scope``). The connection is kept
        for the next request when uvicorn would keep it (the rest of this one's body is then read and
        dropped), except from a client waiting to send its body (``Expect: 100-continue``) or one that no
        longer reads what it is sent: those are closed."""
        started = time.monotonic()
        own_headers, body = _encoded(
            refused.status, refused.message, refused.type, refused.param, refused.code, tuple(refused.headers.items())
        )
        keep_alive = cycle.keep_alive and not cycle.waiting_for_100_continue and not cycle.flow.write_paused
        cycle.transport.write(
            b"".join(
                (
                    STATUS_LINE[refused.status],
                    *(b"%s: %s\r\n" % header_line for header_line in cycle.default_headers),
                    own_headers,
                    b"%s: %s\r\n" % (_REQUEST_ID, request_id_of(scope).encode()),
                    b"" if keep_alive else b"connection: close\r\n",
                    b"\r\n",
                    body,
                )
            )
        )
        cycle.response_started = cycle.response_complete = True
        if not keep_alive:
            cycle.transport.close()
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
            "refused %d image request(s) at the door in %g s (429; the first: %s)",
            self._refused_unlogged,
            REFUSAL_LOG_SECONDS,
            first,
        )
        self._refused_unlogged = 0


_REQUEST_ID = REQUEST_ID_HEADER.encode()


@functools.lru_cache(maxsize=64)
def _encoded(
    status: int, message: str, type: str, param: str | None, code: str | None, headers: tuple[tuple[str, str], ...]
) -> tuple[bytes, bytes]:
    """A refusal's own header lines (its type, length and ``headers``) and its JSON body. A burst's refusals
    say one of a few things (the wait, the queue's length, when to retry), so each is encoded once: the body's
    ``json.dumps`` alone was a quarter of the door's own time in a refusal."""
    body = json.dumps(
        ApiError(status, message, param=param, code=code, type=type).body(), ensure_ascii=False, separators=(",", ":")
    ).encode()
    lines = [("content-type", "application/json"), ("content-length", str(len(body))), *headers]
    return b"".join(b"%s: %s\r\n" % (name.lower().encode(), value.encode()) for name, value in lines), body


def take_place(request: Request) -> AdmissionPlace | None:
    """The place the door gave this request, now the caller's to turn into a slot or to leave."""
    place: AdmissionPlace | None = request.scope.get("state", {}).pop(_PLACE, None)
    return place
