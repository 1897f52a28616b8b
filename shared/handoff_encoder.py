"""Sender side of the contract: one object per handoff that turns rows into wire buffers.

It keeps what ``close`` must report (row counts and frame checksums per stream), splits large
row blocks so no frame exceeds the receiver's payload limit, and never copies row bytes: every
``rows`` call returns the tensor's own memory as one of the buffers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from shared.checksum import stream_checksum
from shared.frame_codec import encode_frame, encode_pixels, encode_row_bytes
from shared.frame_types import Buffer
from shared.frames import AbortFrame, CloseFrame, OpenFrame, PixelRole, StreamName, StreamTotals
from shared.tensor_codec import tensor_bytes, token_ids_to_bytes, wire_dtype

# Frames small enough that the one just hashed is still in cache when it is written out and landed; the size
# that did best of those tried (benchmarks/results/handoff_codec.md).
DEFAULT_MAX_FRAME_PAYLOAD = 4 << 20


class HandoffEncoder:
    def __init__(self, open_frame: OpenFrame, max_frame_payload: int = DEFAULT_MAX_FRAME_PAYLOAD) -> None:
        self.open = open_frame
        self.max_frame_payload = max_frame_payload
        self._frame_checksums: dict[StreamName, dict[int, str]] = {name: {} for name in open_frame.streams}
        self._rows_sent = {name: 0 for name in open_frame.streams}

    def open_frame(self) -> list[Buffer]:
        return [encode_frame(self.open)]

    def pixels(self, role: PixelRole, index: int, payload: Buffer) -> list[Buffer]:
        """The wire buffers of an edit's picture ``index`` or (``mask``, 0) its mask, at the size ``open.edit``
        announced it at (uint8, row-major)."""
        edit = self.open.edit
        announced = {(a.role, a.index): a for a in edit.announced} if edit is not None else {}
        if (role, index) not in announced:
            raise ValueError(f"the handoff was not opened with an edit {role} {index}")
        _, wire = encode_pixels(self.open.request_id, announced[role, index], payload)
        return wire

    def rows(self, stream: StreamName, start: int, token_ids: list[int], rows: torch.Tensor) -> list[Buffer]:
        """The wire buffers for ``rows`` (a host tensor [n, hidden]) starting at row ``start``."""
        return [buf for frame in self.row_frames(stream, start, token_ids, rows) for buf in frame]

    def row_frames(
        self, stream: StreamName, start: int, token_ids: list[int], rows: torch.Tensor
    ) -> Iterator[list[Buffer]]:
        """Like ``rows``, one frame's buffers at a time, each encoded only when asked for.

        A sender that writes each frame before asking for the next hashes a frame and then sends
        it while it is still in cache, instead of hashing a whole prompt before sending any of it.
        """
        if rows.dim() != 2 or rows.shape[1] != self.open.row_width or rows.shape[0] != len(token_ids):
            raise ValueError(
                f"rows {tuple(rows.shape)} do not match row width {self.open.row_width} / {len(token_ids)} ids"
            )
        dtype = wire_dtype(rows.dtype)
        if dtype != self.open.dtype:
            raise ValueError(f"rows are {dtype}, the handoff was opened as {self.open.dtype}")
        # One byte view of the block, taken now; each frame only slices it.
        return self._row_frames(stream, start, token_ids, tensor_bytes(rows), rows.shape[1] * rows.element_size())

    def _row_frames(
        self, stream: StreamName, start: int, token_ids: list[int], payload: memoryview, row_bytes: int
    ) -> Iterator[list[Buffer]]:
        count = len(token_ids)
        per_frame = max(1, self.max_frame_payload // max(1, row_bytes))
        hidden = self.open.row_width
        for first in range(0, count, per_frame):
            n = min(per_frame, count - first)
            frame, wire = encode_row_bytes(
                self.open.request_id,
                stream,
                start + first,
                token_ids[first : first + n],
                self.open.dtype,
                [n, hidden],
                payload[first * row_bytes : (first + n) * row_bytes],
            )
            self._frame_checksums[stream][frame.start] = frame.checksum
            self._rows_sent[stream] += n
            yield wire

    def close(
        self,
        token_ids: Mapping[StreamName, list[int]],
        answer_start_index: Mapping[StreamName, int],
        cached_tokens: int,
        cache_creation_tokens: int,
        timings: dict[str, float] | None = None,
    ) -> list[Buffer]:
        streams = {
            name: StreamTotals(
                rows=self._rows_sent[name],
                token_ids=token_ids_to_bytes(token_ids[name]),
                answer_start_index=answer_start_index[name],
                checksum=stream_checksum(checksums),
            )
            for name, checksums in self._frame_checksums.items()
        }
        frame = CloseFrame(
            request_id=self.open.request_id,
            streams=streams,
            cached_tokens=cached_tokens,
            cache_creation_tokens=cache_creation_tokens,
            timings=timings or {},
        )
        return [encode_frame(frame)]

    def abort(self, reason: str) -> list[Buffer]:
        return [encode_frame(AbortFrame(request_id=self.open.request_id, reason=reason[:1024]))]
