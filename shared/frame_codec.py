"""Frames to bytes and back.

Encoding is scatter/gather: a ``rows`` (or ``pixels``) frame becomes ``[prefix, payload]`` where
``prefix`` is the small msgpack map prefix ending in the ``data`` bin header and ``payload`` is the
tensor's own memory. A sender writes both buffers; the bytes are never concatenated into a new buffer.

Decoding has two paths:

- ``FrameReader``: a push parser for a byte stream (an HTTP request body). It parses each frame's
  header, asks the caller where the payload goes, and copies received bytes straight there —
  one copy from the received bytes, none more.
- ``decode_frame``: plain one-shot decode of a complete frame, for tools and tests.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import torch

from shared.checksum import PayloadHasher, payload_checksum
from shared.errors import ChecksumMismatch, FrameTooLarge, HandoffError, IncompleteStream, MalformedFrame, ShapeMismatch
from shared.frame_types import Buffer
from shared.frames import (
    PIXEL_CHANNELS,
    AnnouncedPixels,
    Frame,
    PayloadFrame,
    PixelsFrame,
    RowsFrame,
    StreamName,
    frame_from_header,
    frame_header,
)
from shared.tensor_codec import (
    TensorLayout,
    check_layout,
    tensor_bytes,
    tensor_from_bytes,
    token_ids_to_bytes,
    wire_dtype,
)

DATA_KEY = "data"
# Received payloads are copied and hashed in slices this size, so the hash reads what the copy
# just brought into cache (well inside the L2 of any current server core).
LANDING_SLICE = 128 << 10
# The first parse of a header reads this much of the chunk: a rows frame's header and a close
# frame of a few thousand tokens parse in one go.
HEADER_PROBE = 32 << 10
_BIN_LENGTH_BYTES = {0xC4: 1, 0xC5: 2, 0xC6: 4}  # bin8, bin16, bin32


def encode_frame(frame: Frame) -> bytes:
    """A frame without row data (``open``, ``close``, ``abort``) as one msgpack map."""
    if isinstance(frame, RowsFrame | PixelsFrame):
        raise TypeError(f"{frame.kind} frames carry data: use encode_rows or encode_pixels")
    packed: bytes = msgpack.packb(frame_header(frame), use_bin_type=True)
    return packed


def encode_rows(
    request_id: str, stream: StreamName, start: int, token_ids: list[int], rows: torch.Tensor
) -> tuple[RowsFrame, list[Buffer]]:
    """The frame for ``rows`` (host tensor [n, hidden]) and its wire buffers ``[prefix, payload]``.

    ``prefix`` is the msgpack map up to and including the ``data`` bin header (``data`` is the last
    entry); ``payload`` is the tensor's own memory.
    """
    return encode_row_bytes(
        request_id, stream, start, token_ids, wire_dtype(rows.dtype), list(rows.shape), tensor_bytes(rows)
    )


def encode_row_bytes(
    request_id: str,
    stream: StreamName,
    start: int,
    token_ids: list[int],
    dtype: str,
    shape: list[int],
    payload: memoryview,
) -> tuple[RowsFrame, list[Buffer]]:
    """``encode_rows`` for rows already viewed as bytes: a sender splitting one tensor into several
    frames slices one byte view instead of making a tensor and a view per frame."""
    frame = RowsFrame(
        request_id=request_id,
        stream=stream,
        start=start,
        count=shape[0],
        token_ids=token_ids_to_bytes(token_ids),
        dtype=dtype,
        shape=shape,
        checksum=payload_checksum(payload),
    )
    return frame, _with_payload(frame, payload)


def encode_pixels(request_id: str, announced: AnnouncedPixels, payload: Buffer) -> tuple[PixelsFrame, list[Buffer]]:
    """The ``pixels`` frame of one picture or mask an edit announced (``height x width x channels`` uint8, row-major)
    and its wire buffers ``[prefix, payload]``."""
    data = memoryview(payload).cast("B")
    frame = PixelsFrame(
        request_id=request_id,
        role=announced.role,
        index=announced.index,
        shape=list(announced.shape),
        checksum=payload_checksum(data),
    )
    if data.nbytes != frame.nbytes:
        raise ValueError(f"{data.nbytes} bytes are not {announced.role} {announced.index} of shape {frame.shape}")
    return frame, _with_payload(frame, data)


def _with_payload(frame: PayloadFrame, payload: memoryview) -> list[Buffer]:
    # Pack the map with 'data' as nil (one byte, 0xc0, last), then put the bin header in its
    # place: always bin32, so the prefix length does not depend on the payload size.
    header = frame_header(frame)
    header[DATA_KEY] = None
    packed = msgpack.packb(header, use_bin_type=True)
    return [packed[:-1] + b"\xc6" + struct.pack(">I", payload.nbytes), payload]


@dataclass(frozen=True)
class DecodedFrame:
    frame: Frame
    rows: torch.Tensor | None = None
    pixels: bytes | None = None


def decode_frame(data: Buffer) -> DecodedFrame:
    """Plain decode of one complete frame (copies a rows payload once into a new tensor)."""
    try:
        header = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise MalformedFrame(f"not a msgpack frame: {exc}") from None
    if not isinstance(header, dict):
        raise MalformedFrame("a frame is a msgpack map")
    payload = header.pop(DATA_KEY, None)
    frame = frame_from_header(header)
    if not isinstance(frame, RowsFrame | PixelsFrame):
        return DecodedFrame(frame)
    if not isinstance(payload, bytes):
        raise MalformedFrame(f"{frame.kind} frame without a bin 'data' entry")
    if isinstance(frame, PixelsFrame):
        _check_pixels(frame, len(payload))
        if payload_checksum(payload) != frame.checksum:
            raise ChecksumMismatch(f"{_payload_name(frame)}: payload checksum mismatch")
        return DecodedFrame(frame, pixels=payload)
    layout = check_layout(frame.dtype, frame.shape)
    rows = tensor_from_bytes(payload, layout)
    if payload_checksum(payload) != frame.checksum:
        raise ChecksumMismatch(f"rows [{frame.start}, {frame.start + frame.count}): payload checksum mismatch")
    return DecodedFrame(frame, rows)


@dataclass(frozen=True)
class FrameLimits:
    """Receiver limits. Nothing is allocated from a size the peer declares beyond these."""

    max_header_bytes: int = 1 << 20
    max_payload_bytes: int = 256 << 20


class RowLanding(Protocol):
    """Where a ``FrameReader`` delivers frames, in stream order."""

    def land(self, frame: RowsFrame, layout: TensorLayout) -> memoryview:
        """Writable memory for this rows frame's payload (exactly ``layout.nbytes``), or raise."""

    def land_pixels(self, frame: PixelsFrame) -> memoryview:
        """Writable memory for this pixels frame's payload (exactly ``frame.nbytes``), or raise."""

    def accept(self, frame: Frame) -> None:
        """A complete frame (a rows frame once its payload has landed)."""


class FrameReader:
    """Push parser: ``feed`` chunks of a frame stream; frames go to the sink as they complete.

    Payloads are copied from the chunks directly into the memory ``sink.land`` (``land_pixels``) returns.
    Header bytes are buffered up to ``limits.max_header_bytes``; a payload is never buffered.
    """

    def __init__(self, sink: RowLanding, limits: FrameLimits = FrameLimits()) -> None:
        self._sink = sink
        self._limits = limits
        self._pending = bytearray()
        self._filling: PayloadFrame | None = None
        self._dest: memoryview | None = None
        self._hasher: PayloadHasher | None = None
        self._filled = 0
        # Most headers fit in one probe; bounded by the header limit so a probe never holds more
        # than a legal header plus the 'data' bin header.
        self._probe = min(HEADER_PROBE, limits.max_header_bytes + 5)
        self.bytes_received = 0
        self.frames = 0

    @property
    def idle(self) -> bool:
        """True between frames: a stream may end here without losing anything."""
        return not self._pending and self._dest is None

    def feed(self, chunk: Buffer) -> None:
        view = memoryview(chunk).cast("B")
        self.bytes_received += view.nbytes
        while view.nbytes:
            if self._dest is not None:
                view = self._fill(view)
                continue
            # Parse from a probe of the chunk, never a whole payload. A header split across
            # chunks is buffered, and the probe grows geometrically so a long header (a close
            # frame's token ids) is re-parsed a few times, not once per probe.
            if self._pending:
                take = min(view.nbytes, 3 * len(self._pending))
                self._pending += view[:take]
                head: Buffer = self._pending
            else:
                take = min(view.nbytes, self._probe)
                head = view[:take]
            parsed = self._parse_header(head)
            if parsed is None:
                if not self._pending:
                    self._pending += head
                if len(self._pending) > self._limits.max_header_bytes:
                    raise FrameTooLarge(f"frame header over {self._limits.max_header_bytes} bytes")
                view = view[take:]
                continue
            frame, consumed = parsed
            # Bytes of the probe past the header are payload or the next frame: re-read them
            # from the caller's chunk rather than from the copy.
            unused = len(head) - consumed
            self._pending.clear()
            view = view[take - unused :]
            if self._dest is None:
                self._deliver(frame)

    def finish(self) -> None:
        """The stream ended: fine between frames, an error inside one."""
        if not self.idle:
            raise IncompleteStream("stream ended inside a frame")

    def _deliver(self, frame: Frame) -> None:
        self.frames += 1
        self._sink.accept(frame)

    def _fill(self, view: memoryview) -> memoryview:
        assert self._dest is not None and self._filling is not None and self._hasher is not None
        take = min(view.nbytes, self._dest.nbytes - self._filled)
        received = view[:take]
        landing = self._dest[self._filled : self._filled + take]
        update = self._hasher.update
        # Copy and hash in cache-sized slices so the hash reads what the copy just brought in.
        for at in range(0, take, LANDING_SLICE):
            piece = landing[at : at + LANDING_SLICE]
            piece[:] = received[at : at + LANDING_SLICE]
            update(piece)
        self._filled += take
        if self._filled == self._dest.nbytes:
            frame = self._filling
            digest = self._hasher.hexdigest()
            self._filling, self._dest = None, None
            if digest != frame.checksum:
                raise ChecksumMismatch(f"{_payload_name(frame)}: payload checksum mismatch")
            self._deliver(frame)
        return view[take:]

    def _parse_header(self, head: Buffer) -> tuple[Frame, int] | None:
        """Parse the frame at the start of ``head``; None if more bytes are needed.

        For a rows or pixels frame this stops at the ``data`` bin header, sets up landing, and
        returns the offset where the payload starts.
        """
        unpacker = msgpack.Unpacker(
            raw=False,
            strict_map_key=True,
            max_buffer_size=max(memoryview(head).nbytes, 1),
            # Limits on declared lengths, so a lying header cannot make msgpack allocate.
            max_str_len=self._limits.max_header_bytes,
            max_array_len=self._limits.max_header_bytes,
            max_map_len=1024,
            max_bin_len=self._limits.max_header_bytes,  # token ids; 'data' is parsed by hand below
            max_ext_len=0,
        )
        unpacker.feed(head)
        try:
            count = unpacker.read_map_header()
            header: dict[str, Any] = {}
            for index in range(count):
                key = unpacker.unpack()
                if key == DATA_KEY:
                    if index != count - 1:
                        raise MalformedFrame("'data' must be the last entry of a frame")
                    self._check_header_size(unpacker.tell())
                    return self._start_payload(header, head, unpacker.tell())
                header[key] = unpacker.unpack()
        except msgpack.OutOfData:
            return None
        except HandoffError:
            raise
        except ValueError as exc:
            # msgpack's only signal for a declared length over the limits it was given.
            if "exceeds max_" in str(exc):
                raise FrameTooLarge(f"frame header over {self._limits.max_header_bytes} bytes: {exc}") from None
            raise MalformedFrame(f"not a msgpack frame map: {exc}") from None
        except Exception as exc:  # msgpack raises TypeError/StackError and more
            raise MalformedFrame(f"not a msgpack frame map: {exc}") from None
        self._check_header_size(unpacker.tell())
        frame = frame_from_header(header)
        if isinstance(frame, RowsFrame | PixelsFrame):
            raise MalformedFrame(f"{frame.kind} frame without a bin 'data' entry")
        return frame, unpacker.tell()

    def _check_header_size(self, nbytes: int) -> None:
        if nbytes > self._limits.max_header_bytes:
            raise FrameTooLarge(f"frame header of {nbytes} bytes over {self._limits.max_header_bytes}")

    def _start_payload(self, header: dict[str, Any], head: Buffer, at: int) -> tuple[Frame, int] | None:
        # Released on the way out: ``head`` may be the header buffer, which must stay resizable.
        with memoryview(head) as view:
            if at >= view.nbytes:
                return None
            width = _BIN_LENGTH_BYTES.get(view[at])
            if width is None:
                raise MalformedFrame("'data' must be a msgpack bin")
            if view.nbytes < at + 1 + width:
                return None
            length = int.from_bytes(view[at + 1 : at + 1 + width], "big")
        frame = frame_from_header(header)
        if not isinstance(frame, RowsFrame | PixelsFrame):
            raise MalformedFrame(f"a {frame.kind} frame carries no data")
        if length > self._limits.max_payload_bytes:
            raise FrameTooLarge(f"payload of {length} bytes over the limit {self._limits.max_payload_bytes}")
        if isinstance(frame, PixelsFrame):
            _check_pixels(frame, length)
            dest = self._sink.land_pixels(frame)
        else:
            layout = check_layout(frame.dtype, frame.shape)
            if layout.nbytes != length:
                raise ShapeMismatch(f"{length} payload bytes do not hold shape {frame.shape} of {frame.dtype}")
            dest = self._sink.land(frame, layout)
        if dest.nbytes != length:
            raise ValueError("land() returned a destination of the wrong size")
        if length:
            self._filling, self._dest, self._filled, self._hasher = frame, dest, 0, PayloadHasher()
        elif payload_checksum(b"") != frame.checksum:
            raise ChecksumMismatch(f"empty {frame.kind} frame with a wrong checksum")
        return frame, at + 1 + width


def _check_pixels(frame: PixelsFrame, length: int) -> None:
    channels = PIXEL_CHANNELS[frame.role]
    if frame.shape[2] != channels:
        raise ShapeMismatch(f"{frame.role} pixels have {channels} channel(s), the frame says {frame.shape[2]}")
    if frame.nbytes != length:
        raise ShapeMismatch(f"{length} payload bytes do not hold {_payload_name(frame)} of shape {frame.shape}")


def _payload_name(frame: PayloadFrame) -> str:
    if isinstance(frame, PixelsFrame):
        return f"{frame.role} {frame.index} pixels"
    return f"rows [{frame.start}, {frame.start + frame.count})"
