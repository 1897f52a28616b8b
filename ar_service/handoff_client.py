"""Sends one request's handoff body to the DiT and reads the images back, on one HTTP exchange.

The request body is a ``HandoffBody`` (open, rows as the engine produces them, close); the row
bytes go to the socket as the tensor's own memory. The answer is the DiT's result stream
(partial images, images, ``done``). ``exchange`` returns the images together with a
``HandoffReport`` of what was sent (bytes, frames, the engine runs' finished events, the tail).

Failures are typed by what they mean for the public API (the mapping to statuses lives in
``ar_service/api/serving.py``): ``DitUnavailable`` (unreachable, not ready, failed), ``DitBusy``
(the DiT has no room: 429), ``DitRejected`` (the DiT refused the request's parameters: 4xx).

The client is aiohttp's, not httpx's: it took half httpx's time per round trip and less of the event
loop's CPU per image (benchmarks/results/handoff_http.md). aiohttp bounds reads (``sock_read``, from the end of
the body on) but not writes, so a write that waits on a DiT that stopped reading is bounded here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import cast

import aiohttp

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
    ResultFrame,
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
    """The body as it goes out: counted, the engine's report taken from its ``close`` frame, and each
    write bounded by ``stall_seconds``: ``write_stall`` expires while a buffer waits that long for the
    DiT to take it (not while the body waits for the engine). aiohttp writes the body from a task of
    its own and reports the body's own failure as a connection error: it is kept as ``failure``."""

    def __init__(self, body: HandoffBody, write_stall: asyncio.Timeout, stall_seconds: float) -> None:
        self._body = body
        self._write_stall = write_stall
        self._stall_seconds = stall_seconds
        self.bytes = 0
        self.frames = 0
        self.engine: EngineReport | None = None
        self.failure: Exception | None = None

    async def buffers(self) -> AsyncIterator[Buffer]:
        loop = asyncio.get_running_loop()
        try:
            async for frame in self._body:
                self.frames += 1
                self.bytes += frame.nbytes
                self.engine = frame.engine or self.engine
                for buffer in frame.buffers:
                    # aiohttp asks for the next buffer once this one is written.
                    self._write_stall.reschedule(loop.time() + self._stall_seconds)
                    yield buffer
                    self._write_stall.reschedule(None)
        except Exception as exc:
            self.failure = exc
            raise

    def report(self, acknowledged_at: float) -> HandoffReport:
        if self.engine is None:
            raise DitUnavailable("the DiT answered before the handoff was complete")
        return HandoffReport(self.bytes, self.frames, self.engine.finished, self.engine.last_row_at, acknowledged_at)


class _Results:
    """The DiT's result stream as it arrives: partial images passed on as they come, images kept,
    ``done`` noted, an error frame raised as the failure it stands for."""

    def __init__(self, on_partial_image: PartialImageSink | None) -> None:
        self._reader = ResultReader()
        self._on_partial_image = on_partial_image
        self.images: list[ImageFrame] = []
        self.done: DoneFrame | None = None

    async def feed(self, chunk: bytes) -> None:
        for frame in self._reader.feed(chunk):
            await self._take(frame)

    async def _take(self, frame: ResultFrame) -> None:
        if isinstance(frame, PartialImageFrame):
            if self._on_partial_image is not None:
                await self._on_partial_image(frame)
        elif isinstance(frame, ImageFrame):
            self.images.append(frame)
        elif isinstance(frame, DoneFrame):
            self.done = frame
        elif isinstance(frame, ErrorFrame):
            raise _failure_of(frame)


class HandoffClient:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        token: str | None,
        *,
        deadline_seconds: float,
        stall_seconds: float,
    ) -> None:
        """``session`` carries the connect and read (stall) timeouts; the caller owns its lifetime.
        ``deadline_seconds`` bounds a whole exchange, however steadily bytes flow; ``stall_seconds``
        each write of the body, as the session's read timeout bounds each read."""
        self._session = session
        self._base_url = base_url
        self._token = token
        self._deadline = deadline_seconds
        self._stall = stall_seconds

    async def reserve(self, request_id: str) -> str:
        """A place at the DiT for this request's handoff, before any engine work: the reservation's id.
        A DiT without room refuses here (``DitBusy``, ``DitNotReady``), so another can be asked."""
        url = f"{self._base_url}{RESERVATIONS_PATH}"
        with _mapped_transport_errors():
            async with self._session.post(url, headers=self._headers(request_id)) as response:
                if response.status != 201:
                    raise await _error_from(response)
                answer = await response.read()
        try:
            return str(json.loads(answer)["reservation"])
        except (ValueError, KeyError, TypeError):
            raise DitUnavailable("the DiT's reservation answer has no reservation") from None

    async def cancel(self, request_id: str, reservation: str) -> None:
        """Give a reserved place back (the request ended before its handoff); best effort: a DiT that
        cannot be told lets the reservation lapse."""
        url = f"{self._base_url}{RESERVATIONS_PATH}/{reservation}"
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with asyncio.timeout(2.0), self._session.delete(url, headers=self._headers(request_id)):
                pass

    async def exchange(
        self, request_id: str, reservation: str, body: HandoffBody, on_partial_image: PartialImageSink | None = None
    ) -> HandoffResult:
        """Send ``body`` in the place ``reservation`` holds; the images, and a report of what was sent."""
        headers = {**self._headers(request_id), "content-type": HANDOFF_MEDIA_TYPE, RESERVATION_HEADER: reservation}
        write_stall = asyncio.timeout(None)
        sending = _Sending(body, write_stall, self._stall)
        try:
            async with asyncio.timeout(self._deadline), write_stall:
                return await self._exchange(headers, sending, on_partial_image)
        except HandoffFailed:
            if sending.failure is not None:  # the engine's failure (say, rows overflowing), not the DiT's
                raise sending.failure from None
            raise
        except TimeoutError:
            if write_stall.expired():
                raise DitUnavailable(f"the DiT took no handoff bytes for {self._stall:g} s") from None
            raise DitUnavailable(f"the DiT did not finish within {self._deadline:g} s") from None

    def _headers(self, request_id: str) -> dict[str, str]:
        headers = {"x-request-id": request_id}
        if self._token:
            headers["authorization"] = f"Bearer {self._token}"
        return headers

    async def _exchange(
        self, headers: dict[str, str], sending: _Sending, on_partial_image: PartialImageSink | None
    ) -> HandoffResult:
        results = _Results(on_partial_image)
        # aiohttp writes any buffer (its types say bytes): the rows go out as the tensor's memory.
        content = cast("AsyncIterable[bytes]", sending.buffers())
        with _mapped_transport_errors():
            async with self._session.post(f"{self._base_url}/v1/handoff", data=content, headers=headers) as response:
                acknowledged_at = time.perf_counter()
                if response.status != 200:
                    raise await _error_from(response)
                async for chunk in response.content.iter_any():
                    await results.feed(chunk)
        if results.done is None:
            raise DitUnavailable("DiT ended the result stream without finishing")
        return HandoffResult(results.images, results.done, sending.report(acknowledged_at))


@contextlib.contextmanager
def _mapped_transport_errors() -> Iterator[None]:
    """aiohttp's failures as what they mean here: no connection made (``DitUnreachable``: nothing was
    sent), or one that failed or went silent past the stall timeout (``DitUnavailable``)."""
    try:
        yield
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
        raise DitUnreachable(f"DiT unreachable: {type(exc).__name__}") from None
    except aiohttp.ClientError as exc:
        raise DitUnavailable(f"DiT connection failed or timed out: {type(exc).__name__}") from None


def _failure_of(frame: ErrorFrame) -> HandoffFailed:
    """An error the DiT sent in its result stream, after it had answered 200."""
    if 400 <= frame.status < 500:
        return DitRejected(frame.status, frame.message, frame.code, None)
    return DitUnavailable(f"DiT failed: {frame.message}")


async def _error_from(response: aiohttp.ClientResponse) -> HandoffFailed:
    try:
        error = json.loads(await response.read()).get("error", {})
    except (ValueError, AttributeError, aiohttp.ClientError):
        error = {}
    message = error.get("message") or f"DiT answered {response.status}"
    retry_after = response.headers.get("retry-after")
    if response.status == 429:
        return DitBusy(message, retry_after=retry_after)
    if response.status >= 500:
        return DitNotReady(message, retry_after=retry_after)
    return DitRejected(response.status, message, error.get("code"), error.get("param"))
