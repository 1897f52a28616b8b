"""``POST /v1/handoff``: the AR service streams hidden rows in, result frames stream back out; and
``POST /v1/handoff/reservations``, where an AR reserves a place before it does any work of its own.

Order of refusals, cheapest first: bearer token (401/503), media type (415), model readiness
(503), room (429: a place, the one the ``x-ardit-reservation`` header names or a free one) — all
before a byte of the body is read. Then the frames: any contract violation, a rejected ``open`` or a
stall answers a 4xx whose ``error.code`` is the HandoffError's code and ``error.type`` is
"handoff_error". Once the handoff is complete the answer is a 200 stream of result frames; failures
after that point arrive as an ``error`` frame.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request, Response
from pydantic import BaseModel
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse

from dit_service.admission import AdmissionControl
from dit_service.conditioning import Conditioning
from dit_service.handoff_intake import HandoffIntake
from dit_service.handoff_services import HandoffServices
from dit_service.handoff_trace import HandoffTrace
from dit_service.metrics import DitMetrics
from dit_service.render_job import EditInput, RenderJob
from services.auth import BearerAuth
from services.errors import ApiError, error_responses
from shared.errors import HandoffError
from shared.frames import OpenFrame
from shared.result_frames import HANDOFF_MEDIA_TYPE, RESERVATION_HEADER, RESERVATIONS_PATH, RESULT_MEDIA_TYPE

HANDOFF_PATH = "/v1/handoff"
_BINARY = {"schema": {"type": "string", "format": "binary"}}


class Reservation(BaseModel):
    """A place held at this DiT for the handoff that sends ``reservation`` in its ``x-ardit-reservation``."""

    reservation: str
    expires_in: float


def api_error_for(exc: HandoffError) -> ApiError:
    return ApiError(exc.status, exc.message, code=exc.code, type="handoff_error", param=exc.param)


@dataclass(frozen=True)
class HandoffEndpoint:
    auth: BearerAuth
    admission: AdmissionControl
    intake: HandoffIntake
    services: Callable[[], HandoffServices]
    metrics: DitMetrics

    def mount(self, app: FastAPI) -> None:
        """Serve this endpoint at ``HANDOFF_PATH`` (documented in the DiT's OpenAPI)."""
        app.add_api_route(
            HANDOFF_PATH,
            self,
            methods=["POST"],
            response_class=StreamingResponse,
            summary="Receive one request's hidden rows; answer with its images (shared/HANDOFF_SPEC.md)",
            openapi_extra={"requestBody": {"required": True, "content": {HANDOFF_MEDIA_TYPE: _BINARY}}},
            responses={
                200: {
                    "description": "Result frames (msgpack): progress, partial images, images, done or error.",
                    "content": {RESULT_MEDIA_TYPE: _BINARY},
                },
                **error_responses(400, 401, 408, 409, 413, 415, 422, 429, 503),
            },
        )
        app.add_api_route(
            RESERVATIONS_PATH,
            self.reserve,
            methods=["POST"],
            status_code=201,
            summary="Hold a place for a handoff, before the sender does any work of its own (shared/HANDOFF_SPEC.md)",
            responses=error_responses(401, 429, 503),
        )
        app.add_api_route(
            RESERVATIONS_PATH + "/{reservation}",
            self.cancel,
            methods=["DELETE"],
            status_code=204,
            response_class=Response,
            summary="Give a reserved place back: the sender will not send its handoff",
            responses=error_responses(401, 503),
        )

    async def reserve(self, request: Request) -> Reservation:
        self._check_sender(request)
        self.services()  # a DiT that cannot render now is not reserved: 503
        return Reservation(reservation=self.admission.reserve(), expires_in=self.admission.reservation_seconds)

    async def __call__(self, request: Request) -> Response:
        started = time.monotonic()
        try:
            return await self._handle(request, started)
        except ApiError:
            self.metrics.request_seconds.observe(time.monotonic() - started)
            raise

    async def cancel(self, reservation: str, request: Request) -> Response:
        self._check_sender(request)
        self.admission.cancel(reservation)
        return Response(status_code=204)

    def _check_sender(self, request: Request) -> None:
        if not self.auth.enabled:
            # Fail closed: an unconfigured receiver must not accept hidden states from anyone.
            raise ApiError(
                503, "the handoff token (ARDIT_HANDOFF_TOKEN) is not configured", code="handoff_auth_not_configured"
            )
        self.auth.check(request.headers.get("authorization"))

    async def _handle(self, request: Request, started: float) -> Response:
        first_byte_ns = time.time_ns()
        self._check_sender(request)
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != HANDOFF_MEDIA_TYPE:
            raise ApiError(
                415, f"content-type must be {HANDOFF_MEDIA_TYPE}", code="unsupported_media_type", param="content-type"
            )
        services = self.services()
        place = self.admission.place(request.headers.get(RESERVATION_HEADER))
        try:
            frame, conditioning, edit = await self._receive(request, services)
        except HandoffError as exc:
            place.release()
            raise api_error_for(exc) from None
        except ClientDisconnect:
            # Nobody is left to answer; the intake already released the rows and counted it.
            place.release()
            return Response(status_code=499)
        except BaseException:
            place.release()
            raise
        job = RenderJob(
            request_id=frame.request_id,
            conditioning=conditioning,
            params=frame.diffusion,
            trace=HandoffTrace.received(frame, first_byte_ns),
            edit=edit,
        )
        return services.results.respond(job, place, started, handoff_seconds=time.monotonic() - started)

    async def _receive(
        self, request: Request, services: HandoffServices
    ) -> tuple[OpenFrame, Conditioning, EditInput | None]:
        # Kept in its own frame so no reference to the row buffer outlives the intake block.
        async with self.intake.receive(request.stream(), services.policy.check) as received:
            handoff, adapter = received.handoff, received.accepted
            edit = EditInput.of(handoff.edit) if handoff.edit is not None else None
            return handoff.open, adapter.select(handoff), edit
