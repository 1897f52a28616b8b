"""``POST /v1/handoff``: the AR service streams hidden rows in, result frames stream back out.

Order of refusals, cheapest first: bearer token (401/503), media type (415), model readiness
(503), capacity (429) — all before a byte of the body is read. Then the frames: any contract
violation, a rejected ``open`` or a stall answers a 4xx whose ``error.code`` is the HandoffError's
code and ``error.type`` is "handoff_error". Once the handoff is complete the answer is a 200
stream of result frames; failures after that point arrive as an ``error`` frame.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request, Response
from starlette.requests import ClientDisconnect

from dit_service.admission import AdmissionControl
from dit_service.conditioning import Conditioning, ConditioningAdapters
from dit_service.edit_input import EditInput
from dit_service.handoff_intake import HandoffIntake
from dit_service.handoff_trace import HandoffTrace
from dit_service.metrics import DitMetrics
from dit_service.open_frame_policy import OpenFramePolicy
from dit_service.pipeline_runner import RenderJob
from dit_service.result_stream import ResultStream
from services.auth import BearerAuth
from services.errors import ApiError
from shared.capabilities import DitCapabilities
from shared.errors import HandoffError
from shared.frames import OpenFrame
from shared.result_frames import HANDOFF_MEDIA_TYPE

HANDOFF_PATH = "/v1/handoff"


@dataclass(frozen=True)
class HandoffServices:
    """What serving a handoff needs once the model is loaded."""

    capabilities: DitCapabilities
    policy: OpenFramePolicy
    adapters: ConditioningAdapters
    results: ResultStream


def api_error_for(exc: HandoffError) -> ApiError:
    return ApiError(exc.status, exc.message, code=exc.code, type="handoff_error", param=getattr(exc, "param", None))


class HandoffEndpoint:
    def __init__(
        self,
        auth: BearerAuth,
        admission: AdmissionControl,
        intake: HandoffIntake,
        services: Callable[[], HandoffServices],
        metrics: DitMetrics,
    ) -> None:
        self._auth = auth
        self._admission = admission
        self._intake = intake
        self._services = services
        self._metrics = metrics

    async def __call__(self, request: Request) -> Response:
        started = time.monotonic()
        try:
            return await self._handle(request, started)
        except ApiError:
            self._metrics.request_seconds.observe(time.monotonic() - started)
            raise

    async def _handle(self, request: Request, started: float) -> Response:
        first_byte_ns = time.time_ns()
        if not self._auth.enabled:
            # Fail closed: an unconfigured receiver must not accept hidden states from anyone.
            raise ApiError(
                503, "the handoff token (ARDIT_HANDOFF_TOKEN) is not configured", code="handoff_auth_not_configured"
            )
        self._auth.check(request.headers.get("authorization"))
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != HANDOFF_MEDIA_TYPE:
            raise ApiError(
                415, f"content-type must be {HANDOFF_MEDIA_TYPE}", code="unsupported_media_type", param="content-type"
            )
        services = self._services()
        with self._admission.handoff_slot():
            try:
                frame, conditioning, edit = await self._receive(request, services)
            except HandoffError as exc:
                raise api_error_for(exc) from None
            except ClientDisconnect:
                # Nobody is left to answer; the intake already released the rows and counted it.
                return Response(status_code=499)
            ticket = self._admission.run_ticket()
        job = RenderJob(
            request_id=frame.request_id,
            conditioning=conditioning,
            params=frame.diffusion,
            trace=HandoffTrace.received(frame, first_byte_ns),
            edit=edit,
        )
        return services.results.respond(job, ticket, started, handoff_seconds=time.monotonic() - started)

    async def _receive(
        self, request: Request, services: HandoffServices
    ) -> tuple[OpenFrame, Conditioning, EditInput | None]:
        # Kept in its own frame so no reference to the row buffer outlives the intake block.
        async with self._intake.receive(request.stream(), services.policy.check) as handoff:
            adapter = services.adapters.get(handoff.open.conditioning)
            edit = EditInput.of(handoff.edit) if handoff.edit is not None else None
            return handoff.open, adapter.select(handoff), edit
