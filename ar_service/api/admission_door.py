"""The image routes' door: a request takes its admission place on arrival, before its body is parsed.

Pure ASGI, behind the public gate (API key, body size and deadline) and in front of FastAPI: a
request the line has no room for is answered 429 here, with ``Retry-After``, without routing, body
parsing, validation or tokenizing. That keeps a refusal to a few hundred microseconds of one
event loop, so a burst of hundreds is refused within one pass over it (a refusal that went through
the whole app cost about ten times as much, and a burst's refusals waited for each other's).

The place travels in the request's ASGI state (``take_place``); from then serving owns it. A request
that never reaches serving (a body that does not parse, say) gives its place back here. Before the
pair is known to be ready the door lets requests through: serving answers them (503 ``not_ready``)
and admits those it serves itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from ar_service.admission import AdmissionPlace, RequestAdmission
from ar_service.readiness import ArReadiness
from services.errors import ApiError, ErrorObserver

_PLACE = "admission_place"


class AdmissionDoor:
    def __init__(
        self,
        app: ASGIApp,
        *,
        admission: RequestAdmission,
        readiness: ArReadiness,
        paths: Iterable[str],
        on_refusal: ErrorObserver,
    ) -> None:
        """``paths``: the routes (POST) whose requests are admitted; ``on_refusal`` sees every 429."""
        self.app = app
        self._admission = admission
        self._readiness = readiness
        self._paths = frozenset(paths)
        self._on_refusal = on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        capacity = self._readiness.known_capacity() if self._admits(scope) else None
        if capacity is None:
            await self.app(scope, receive, send)
            return
        try:
            place = self._admission.enter(capacity)
        except ApiError as refused:
            self._on_refusal(refused)
            await refused.response()(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state[_PLACE] = place
        try:
            # The requests of a burst arrive together: each takes its place (or its 429) before any
            # of them goes on to parsing and validation, so no refusal waits for another's work.
            await asyncio.sleep(0)
            await self.app(scope, receive, send)
        finally:
            if state.pop(_PLACE, None) is place:
                place.leave()

    def _admits(self, scope: Scope) -> bool:
        return scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self._paths


def take_place(request: Request) -> AdmissionPlace | None:
    """The place the door gave this request, now the caller's to turn into a slot or to leave."""
    place: AdmissionPlace | None = request.scope.get("state", {}).pop(_PLACE, None)
    return place
