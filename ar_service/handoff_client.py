"""Sends one request's hidden rows to the DiT and reads the images back, on one HTTP exchange.

The request body is the frame stream of the shared contract (``HandoffEncoder``), produced while
the AR engine is still running: each ``RowsEvent`` becomes frames as soon as it arrives, so the
transfer overlaps prefill and decoding. The row bytes go to the socket as the tensor's own memory.
The answer is the DiT's result stream (partial images, images, ``done``).

Failures are typed for the public API: ``DitUnavailable`` (connect/timeout/5xx/429 → 503) and
``DitRejected`` (the DiT refused the handoff with a 4xx, e.g. a size it cannot render).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from shared.frame_types import Buffer
from shared.handoff_encoder import HandoffEncoder
from shared.result_frames import (
    HANDOFF_MEDIA_TYPE,
    DoneFrame,
    ErrorFrame,
    ImageFrame,
    PartialImageFrame,
    ResultReader,
)


class DitUnavailable(Exception):
    """The DiT cannot be reached, is not ready, is overloaded, or failed."""

    def __init__(self, message: str, retry_after: str | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class DitRejected(Exception):
    """The DiT refused the handoff (4xx); ``code``/``param`` come from its error body."""

    def __init__(self, status: int, message: str, code: str | None, param: str | None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param


@dataclass
class HandoffStats:
    bytes_sent: int = 0
    frames_sent: int = 0
    # perf_counter when the AR produced its last row (set by the frame source; else when the
    # close frame was handed to the transport)
    last_row_at: float | None = None
    acknowledged_at: float | None = None  # perf_counter when the DiT answered (handoff complete)

    @property
    def handoff_latency(self) -> float | None:
        """AR's last row → DiT holds the complete conditioning (the tail not hidden by decoding)."""
        if self.last_row_at is None or self.acknowledged_at is None:
            return None
        return max(0.0, self.acknowledged_at - self.last_row_at)


@dataclass
class RenderResult:
    images: list[ImageFrame] = field(default_factory=list)
    done: DoneFrame | None = None
    stats: HandoffStats = field(default_factory=HandoffStats)


# Yields the handoff one frame at a time (each a list of wire buffers); the client marks the last
# one (close) as it is sent.
FrameSource = Callable[[HandoffEncoder], AsyncIterator[list[Buffer]]]
PartialImageSink = Callable[[PartialImageFrame], Awaitable[None]]


class HandoffClient:
    def __init__(self, base_url: str, token: str | None, connect_timeout: float, render_timeout: float) -> None:
        self._token = token
        self._client = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(render_timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def ready(self) -> bool:
        try:
            response = await self._client.get("/readyz", timeout=2.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def render(
        self,
        encoder: HandoffEncoder,
        frames: FrameSource,
        on_partial_image: PartialImageSink | None = None,
        stats: HandoffStats | None = None,
    ) -> RenderResult:
        result = RenderResult(stats=stats or HandoffStats())
        stats = result.stats

        async def body() -> AsyncIterator[Buffer]:
            async for buffers in frames(encoder):
                for buf in buffers:
                    stats.bytes_sent += memoryview(buf).nbytes
                    yield buf
                stats.frames_sent += 1
            if stats.last_row_at is None:
                stats.last_row_at = time.perf_counter()

        headers = {"content-type": HANDOFF_MEDIA_TYPE, "x-request-id": encoder.open.request_id}
        if self._token:
            headers["authorization"] = f"Bearer {self._token}"
        try:
            async with self._client.stream("POST", "/v1/handoff", content=body(), headers=headers) as response:
                stats.acknowledged_at = time.perf_counter()
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
                            result.images.append(frame)
                        elif isinstance(frame, DoneFrame):
                            result.done = frame
                        elif isinstance(frame, ErrorFrame):
                            if 400 <= frame.status < 500:
                                raise DitRejected(frame.status, frame.message, frame.code, None)
                            raise DitUnavailable(f"DiT failed: {frame.message}")
        except (httpx.TransportError, httpx.TimeoutException) as exc:
            raise DitUnavailable(f"DiT unreachable or timed out: {type(exc).__name__}") from None
        if result.done is None:
            raise DitUnavailable("DiT ended the result stream without finishing")
        return result


def _error_from(response: httpx.Response) -> Exception:
    try:
        error = response.json().get("error", {})
    except ValueError:
        error = {}
    message = error.get("message") or f"DiT answered {response.status_code}"
    if response.status_code in (429, 503) or response.status_code >= 500:
        return DitUnavailable(message, retry_after=response.headers.get("retry-after"))
    return DitRejected(response.status_code, message, error.get("code"), error.get("param"))
