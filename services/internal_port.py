"""A second port for a cluster's own callers, with no API key: the network decides who reaches it.

Requests that arrive on ``port`` reach only ``paths`` (the AR: the endpoint picker's
``/v1/completions/render`` and the probes); anything else there is a 404, so the internal port never
serves images. Kubernetes' NetworkPolicy lets only the endpoint picker and Prometheus reach it
(deploy/kubernetes/networkpolicy.yaml). Requests on every other port go to ``public``.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from services.errors import ApiError


class InternalPort:
    def __init__(self, public: ASGIApp, internal: ASGIApp, *, port: int, paths: Iterable[str]) -> None:
        self.public = public
        self.internal = internal
        self.port = port
        self.paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server")
        if scope["type"] != "http" or server is None or server[1] != self.port:
            await self.public(scope, receive, send)
        elif scope["path"] in self.paths:
            await self.internal(scope, receive, send)
        else:
            refused = ApiError(404, "the internal port serves only the cluster's own calls", code="not_found")
            await refused.response()(scope, receive, send)
