"""Sends one request's handoff body to the DiT and reads the images back, on one HTTP exchange.

The request body is a ``HandoffBody`` (open, rows as the engine produces them, close); the row
bytes go to the socket as the tensor's own memory. The answer is the DiT's result stream
(partial images, images, ``done``). ``exchange`` returns the images together with a
``HandoffReport`` of what was sent (bytes, frames, the engine runs' finished events, the tail).

Failures are typed by what they mean for the public API (the mapping to statuses lives in
``ar_service/api/serving.py``): ``DitUnavailable`` (unreachable, not ready, failed), ``DitBusy``
(the DiT has no room: 429), ``DitRejected`` (the DiT refused the request's parameters: 4xx).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import cast

import httpx

from ar_service.engine.hidden_state_engine import FinishedEvent
from ar_service.handoff_body import EngineReport, HandoffBody
from shared.frame_types import Buffer
from shared.frames import StreamName
from shared.result_frames import (
    HANDOFF_MEDIA_TYPE,
    RESERVATION_HEADER,
    RESERVATIONS_PATH,
    DoneFrame,
    ErrorFrame,
    ImageFrame,
    PartialImageFrame,
    ResultReader,
)

PartialImageSink = Callable[[PartialImageFrame], Awaitable[None]]


class HandoffFailed(Exception):
    """The handoff did not produce images. ``reason`` labels the failure metric; ``retry_after`` is the
    DiT's ``Retry-After``, when it sent one."""

    reason = "failed"

    def __init__(self, message: str, *, retry_after: str | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class DitUnavailable(HandoffFailed):
    """The DiT cannot be reached, is not ready, or failed while rendering."""

    reason = "dit_unavailable"


class DitUnreachable(DitUnavailable):
    """No connection could be made: nothing of the handoff was sent."""

    reason = "dit_unreachable"


class DitNotReady(DitUnavailable):
    """The DiT answered 5xx before any result (not ready, shutting down): it took none of the request."""

    reason = "dit_not_ready"


class DitBusy(HandoffFailed):
    """The DiT is healthy but has no room for this handoff now (it answered 429)."""

    reason = "dit_busy"


class DitRejected(HandoffFailed):
    """The DiT refused the handoff (4xx); ``code``/``param`` come from its error body."""

    reason = "dit_rejected"

    def __init__(self, status: int, message: str, code: str | None, param: str | None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param


@dataclass(frozen=True)
class HandoffReport:
    bytes_sent: int
    frames_sent: int
    finished: Mapping[StreamName, FinishedEvent]  # each engine run's finished event
    last_row_at: float  # perf_counter when the engine handed over its last rows
    acknowledged_at: float  # perf_counter when the DiT answered: it holds the complete conditioning

    @property
    def handoff_latency(self) -> float:
        """AR's last row → DiT holds the complete conditioning (the tail not hidden by decoding)."""
        return max(0.0, self.acknowledged_at - self.last_row_at)


@dataclass(frozen=True)
class HandoffResult:
    images: list[ImageFrame]
    done: DoneFrame
    report: HandoffReport


class _Sending:
    """The body as it goes out: counted, and the engine's report taken from its ``close`` frame."""

    def __init__(self, body: HandoffBody) -> None:
        self._body = body
        self.bytes = 0
        self.frames = 0
        self.engine: EngineReport | None = None

    async def buffers(self) -> AsyncIterator[Buffer]:
        async for frame in self._body:
            self.frames += 1
            self.bytes += frame.nbytes
            self.engine = frame.engine or self.engine
            for buffer in frame.buffers:
                yield buffer

    def report(self, acknowledged_at: float) -> HandoffReport:
        if self.engine is None:
            raise DitUnavailable("the DiT answered before the handoff was complete")
        return HandoffReport(self.bytes, self.frames, self.engine.finished, self.engine.last_row_at, acknowledged_at)


class HandoffClient:
    def __init__(self, client: httpx.AsyncClient, token: str | None, deadline_seconds: float) -> None:
        """``client`` carries the DiT's base URL and per-read/write (stall) timeouts; the caller owns
        its lifetime. ``deadline_seconds`` bounds a whole exchange, however steadily bytes flow."""
        self._client = client
        self._token = token
        self._deadline = deadline_seconds

    async def reserve(self, request_id: str) -> str:
        """A place at the DiT for this request's handoff, before any engine work: the reservation's id.
        A DiT without room refuses here (``DitBusy``, ``DitNotReady``), so another can be asked."""
        try:
            response = await self._client.post(RESERVATIONS_PATH, headers=self._headers(request_id))
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise DitUnreachable(f"DiT unreachable: {type(exc).__name__}") from None
        except (httpx.TransportError, httpx.TimeoutException) as exc:
            raise DitUnavailable(f"DiT connection failed or timed out: {type(exc).__name__}") from None
        if response.status_code != 201:
            raise _error_from(response)
        try:
            return str(response.json()["reservation"])
        except (ValueError, KeyError, TypeError):
            raise DitUnavailable("the DiT's reservation answer has no reservation") from None

    async def cancel(self, request_id: str, reservation: str) -> None:
        """Give a reserved place back (the request ended before its handoff); best effort: a DiT that
        cannot be told lets the reservation lapse."""
        with contextlib.suppress(httpx.HTTPError):
            await self._client.delete(
                f"{RESERVATIONS_PATH}/{reservation}", headers=self._headers(request_id), timeout=2.0
            )

    async def exchange(
        self, request_id: str, reservation: str, body: HandoffBody, on_partial_image: PartialImageSink | None = None
    ) -> HandoffResult:
        """Send ``body`` in the place ``reservation`` holds; the images, and a report of what was sent."""
        headers = {**self._headers(request_id), "content-type": HANDOFF_MEDIA_TYPE, RESERVATION_HEADER: reservation}
        try:
            async with asyncio.timeout(self._deadline):
                return await self._exchange(headers, _Sending(body), on_partial_image)
        except TimeoutError:
            raise DitUnavailable(f"the DiT did not finish within {self._deadline:g} s") from None

    def _headers(self, request_id: str) -> dict[str, str]:
        headers = {"x-request-id": request_id}
        if self._token:
            headers["authorization"] = f"Bearer {self._token}"
        return headers

    async def _exchange(
        self, headers: dict[str, str], sending: _Sending, on_partial_image: PartialImageSink | None
    ) -> HandoffResult:
        images: list[ImageFrame] = []
        done: DoneFrame | None = None
        try:
            # httpx writes any buffer (its types say bytes): the rows go out as the tensor's memory.
            content = cast("AsyncIterable[bytes]", sending.buffers())
            async with self._client.stream("POST", "/v1/handoff", content=content, headers=headers) as response:
                acknowledged_at = time.perf_counter()
                if response.status_code != 200:
                    await response.aread()
                    raise _error_from(response)
                reader = ResultReader()
                async for chunk in response.aiter_raw():
                    for frame in reader.feed(chunk):
                        if isinstance(frame, PartialImageFrame):
                            if on_partial_image is not None:
                                await on_partial_image(frame)
                        elif isinstance(frame, ImageFrame):
                            images.append(frame)
                        elif isinstance(frame, DoneFrame):
                            done = frame
                        elif isinstance(frame, ErrorFrame):
                            if 400 <= frame.status < 500:
                                raise DitRejected(frame.status, frame.message, frame.code, None)
                            raise DitUnavailable(f"DiT failed: {frame.message}")
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise DitUnreachable(f"DiT unreachable: {type(exc).__name__}") from None
        except (httpx.TransportError, httpx.TimeoutException) as exc:
            raise DitUnavailable(f"DiT connection failed or timed out: {type(exc).__name__}") from None
        if done is None:
            raise DitUnavailable("DiT ended the result stream without finishing")
        return HandoffResult(images, done, sending.report(acknowledged_at))


def _error_from(response: httpx.Response) -> HandoffFailed:
    try:
        error = response.json().get("error", {})
    except ValueError:
        error = {}
    message = error.get("message") or f"DiT answered {response.status_code}"
    retry_after = response.headers.get("retry-after")
    if response.status_code == 429:
        return DitBusy(message, retry_after=retry_after)
    if response.status_code >= 500:
        return DitNotReady(message, retry_after=retry_after)
    return DitRejected(response.status_code, message, error.get("code"), error.get("param"))
