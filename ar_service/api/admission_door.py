"""The image routes' door: a request takes its admission place on arrival, before anything else.

Pure ASGI, the outermost layer of the app (in front of traces, metrics, the request-id layer, the
drain gate, the public gate and FastAPI): a request the line has no room for is answered 429 here,
with ``Retry-After``, without a span, routing, body parsing, validation or tokenizing: about 20
microseconds of the event loop in-process, against about 70 through the whole stack, so a burst of
hundreds is answered within one pass over it. The door counts its refusals (``http_requests`` and
``api_errors``, as the layers behind it would have) and gives them a request id, also in the
access log.

The door decides only what it can decide alone: a request without a valid API key, one that
arrives while the service drains, one on the internal port, or any before the pair is known to be
ready goes on, and the layers behind answer it (401, 503, 404) — serving admits those it serves
itself.

The place travels in the request's ASGI state (``take_place``); from then serving owns it. A request
that never reaches serving (a body that does not parse, say) gives its place back here.
"""

from __future__ import annotations

import asyncio
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
from services.request_context import REQUEST_ID_HEADER, request_id_of, request_id_var
from services.request_gate import header

_PLACE = "admission_place"


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
        """``paths``: the routes (POST) whose requests are admitted; ``auth``: the public API keys (the
        gate behind checks them again and answers a wrong one)."""
        self.app = app
        self._admission = admission
        self._readiness = readiness
        self._paths = frozenset(paths)
        self._auth = auth
        self._drain = drain
        self._metrics = metrics
        self._internal_port = internal_port
        self._one_at_a_time = asyncio.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrived = time.monotonic()
        capacity = self._readiness.known_capacity() if self._decides(scope) else None
        if capacity is None:
            await self.app(scope, receive, send)
            return
        try:
            place = self._admission.enter(capacity)
        except ApiError as refused:
            await self._refuse(refused, scope, receive, send)
            self._metrics.observe_response(scope["path"], "POST", str(refused.status), time.monotonic() - arrived)
            return
        state = scope.setdefault("state", {})
        state[_PLACE] = place
        try:
            # One admitted request goes on to its work (parsing, validation, tokenizing: a few hundred
            # microseconds) per loop pass, and the requests read in between are answered between them:
            # a refusal waits behind at most one request's work, however a burst's bytes arrive.
            async with self._one_at_a_time:
                await asyncio.sleep(0)
            await self.app(scope, receive, send)
        finally:
            if state.pop(_PLACE, None) is place:
                place.leave()

    def _decides(self, scope: Scope) -> bool:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self._paths:
            return False
        server = scope.get("server")
        on_internal_port = self._internal_port is not None and server is not None and server[1] == self._internal_port
        if self._drain.started or on_internal_port:
            return False
        return not self._auth.enabled or self._auth.accepts(header(scope, b"authorization"))

    async def _refuse(self, refused: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = request_id_of(scope)
        refused.headers[REQUEST_ID_HEADER] = request_id
        self._metrics.count_error(refused)
        token = request_id_var.set(request_id)  # the access log line names it
        try:
            await refused.response()(scope, receive, send)
        finally:
            request_id_var.reset(token)


def take_place(request: Request) -> AdmissionPlace | None:
    """The place the door gave this request, now the caller's to turn into a slot or to leave."""
    place: AdmissionPlace | None = request.scope.get("state", {}).pop(_PLACE, None)
    return place
