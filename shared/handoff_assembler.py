"""Receiver side of the contract: frames in, one validated set of hidden rows out.

``HandoffAssembler`` enforces every ordering and consistency rule of HANDOFF_SPEC.md. Row memory
(and an edit's pixel memory) is allocated once, from the ``open`` frame, after checking the declared
sizes against the caps and letting the receiver refuse the ``open`` itself (``check_open``); rows land by
index, an edit's pictures and mask in the order the ``open`` announced them (each frame's payload checksum
is checked as it lands, by the reader); ``close`` is accepted only when row counts, token ids and the stream
checksums agree and every announced image arrived.
``HandoffReceiver`` glues it to a ``FrameReader`` for a byte stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.checksum import stream_checksum
from shared.errors import (
    AllocationTooLarge,
    ChecksumMismatch,
    DtypeNotAllowed,
    FrameAfterClose,
    FrameOutOfOrder,
    HandoffAborted,
    IncompleteStream,
    MissingPixels,
    OverlappingRows,
    RowCountMismatch,
    RowsOutOfBounds,
    ShapeMismatch,
    TokenCountMismatch,
)
from shared.frame_codec import FrameLimits, FrameReader
from shared.frame_types import Buffer
from shared.frames import (
    AbortFrame,
    AnnouncedPixels,
    CloseFrame,
    Frame,
    OpenFrame,
    PixelsFrame,
    RowsFrame,
    StreamName,
    StreamTotals,
)
from shared.row_buffer_pool import RowBufferPool
from shared.tensor_codec import (
    ALLOWED_DTYPES,
    TOKEN_ID_BYTES,
    TensorLayout,
    byte_view,
    check_layout,
    token_ids_from_bytes,
)


@dataclass(frozen=True)
class AssemblyCaps:
    """Hard caps checked against the ``open`` frame before anything is allocated."""

    max_rows: int = 32768
    max_row_width: int = 16384
    # Rows and an edit's pixels together.
    max_bytes: int = 2 << 30
    # Largest width x height of one picture of an edit (the DiT sets its own max_pixels here).
    max_image_pixels: int = 16 << 20
    # Largest width x height of an edit's pictures together.
    max_edit_pixels: int = 64 << 20


@dataclass(frozen=True)
class AssembledStream:
    rows: torch.Tensor  # [rows, hidden], source dtype
    token_ids: list[int]
    answer_start_index: int
    prefix_tokens: int | None  # from open: template tokens whose rows do not condition the DiT


@dataclass(frozen=True)
class AssembledEdit:
    pictures: tuple[torch.Tensor, ...]  # each [height, width, 3] uint8, RGB, at its own size
    mask: torch.Tensor | None  # [height, width, 1] uint8 (the first picture's size), nonzero = repaint
    strength: float | None  # None: a reference edit


@dataclass(frozen=True)
class AssembledHandoff:
    open: OpenFrame
    close: CloseFrame
    streams: dict[StreamName, AssembledStream]
    edit: AssembledEdit | None = None


class _PixelBuffer:
    """One picture or mask of an edit, owned by the handoff (never pooled: the render keeps it after release)."""

    def __init__(self, announced: AnnouncedPixels) -> None:
        self.announced = announced
        self.pixels = torch.empty(announced.shape, dtype=torch.uint8)
        self.bytes = byte_view(self.pixels)
        self.received = False


class _StreamBuffer:
    def __init__(self, max_rows: int, hidden: int, dtype: torch.dtype, pool: RowBufferPool | None) -> None:
        nbytes = max_rows * hidden * dtype.itemsize
        self.raw = pool.acquire(nbytes) if pool is not None else torch.empty(nbytes, dtype=torch.uint8)
        self.rows = self.raw[:nbytes].view(dtype).reshape(max_rows, hidden)
        self.bytes = byte_view(self.raw)[:nbytes]
        self.row_bytes = hidden * dtype.itemsize
        self.filled = bytearray(max_rows)
        self.token_ids = bytearray(max_rows * TOKEN_ID_BYTES)  # wire form: uint32 per row
        self.received = 0
        self.frame_checksums: dict[int, str] = {}


class HandoffAssembler:
    """Validates and assembles one handoff.

    With a ``pool``, row memory is borrowed from it: the tensors of ``result()`` stay valid until
    ``release()``, which the consumer calls once it has taken what it needs. ``check_open`` sees the ``open``
    frame once it is within the caps, before anything is allocated: what it raises refuses the handoff.
    """

    def __init__(
        self,
        caps: AssemblyCaps = AssemblyCaps(),
        pool: RowBufferPool | None = None,
        check_open: Callable[[OpenFrame], None] | None = None,
    ) -> None:
        self._caps = caps
        self._pool = pool
        self._check_open = check_open
        self.open: OpenFrame | None = None
        self._streams: dict[StreamName, _StreamBuffer] = {}
        # The edit's pictures, then its mask, in the order they must arrive; the first ``_landed`` of them have.
        self._pixels: list[_PixelBuffer] = []
        self._landed = 0
        self._result: AssembledHandoff | None = None

    @property
    def complete(self) -> bool:
        return self._result is not None

    @property
    def allocated_bytes(self) -> int:
        rows = sum(s.raw.numel() for s in self._streams.values())
        return rows + sum(p.pixels.numel() for p in self._pixels)

    def result(self) -> AssembledHandoff:
        if self._result is None:
            raise IncompleteStream("the handoff has not been closed")
        return self._result

    def release(self) -> None:
        """Give back the row memory (on failure, or once the consumer has taken what it needs)."""
        if self._pool is not None:
            for stream in self._streams.values():
                self._pool.release(stream.raw)
        self._streams.clear()
        self._pixels.clear()
        self._landed = 0
        self._result = None

    def accept(self, frame: Frame) -> None:
        """Apply a frame without payload (a rows frame is applied by ``land``)."""
        if self._result is not None:
            raise FrameAfterClose(f"{frame.kind} frame after close")
        if isinstance(frame, AbortFrame):
            self.release()
            raise HandoffAborted(f"sender aborted: {frame.reason}")
        if isinstance(frame, OpenFrame):
            self._open(frame)
            return
        if self.open is None:
            raise FrameOutOfOrder(f"{frame.kind} frame before open")
        if frame.request_id != self.open.request_id:
            raise FrameOutOfOrder(f"frame for request {frame.request_id!r} in handoff {self.open.request_id!r}")
        if isinstance(frame, CloseFrame):
            self._close(frame)
        elif isinstance(frame, RowsFrame):
            # Landed (``land`` checked its stream) and its payload checksum verified by the
            # reader; keep it for close.
            self._streams[frame.stream].frame_checksums[frame.start] = frame.checksum
        elif isinstance(frame, PixelsFrame):
            self._pixels[self._landed - 1].received = True  # landed (``land_pixels``) and its checksum verified
        else:  # pragma: no cover - Frame is a closed union
            raise TypeError(type(frame))

    def land(self, frame: RowsFrame, layout: TensorLayout) -> memoryview:
        """Validate a rows frame and return the slice of the row buffer its payload fills."""
        if self._result is not None:
            raise FrameAfterClose("rows frame after close")
        if self.open is None:
            raise FrameOutOfOrder("rows frame before open")
        if frame.request_id != self.open.request_id:
            raise FrameOutOfOrder(f"frame for request {frame.request_id!r} in handoff {self.open.request_id!r}")
        stream = self._streams.get(frame.stream)
        if stream is None:
            raise RowsOutOfBounds(f"stream {frame.stream!r} was not declared in open")
        if frame.dtype != self.open.dtype:
            raise DtypeNotAllowed(f"rows dtype {frame.dtype} differs from the handoff's {self.open.dtype}")
        if layout.shape != (frame.count, self.open.row_width):
            raise ShapeMismatch(f"shape {list(layout.shape)} is not [{frame.count}, {self.open.row_width}]")
        if len(frame.token_ids) != frame.count * TOKEN_ID_BYTES:
            raise TokenCountMismatch(f"{len(frame.token_ids) // TOKEN_ID_BYTES} token ids for {frame.count} rows")
        end = frame.start + frame.count
        if end > len(stream.filled):
            raise RowsOutOfBounds(f"rows [{frame.start}, {end}) outside [0, {len(stream.filled)}) of {frame.stream}")
        if 1 in stream.filled[frame.start : end]:
            raise OverlappingRows(f"rows [{frame.start}, {end}) of {frame.stream} overlap rows already received")
        stream.filled[frame.start : end] = b"\x01" * frame.count
        stream.token_ids[frame.start * TOKEN_ID_BYTES : end * TOKEN_ID_BYTES] = frame.token_ids
        stream.received += frame.count
        return stream.bytes[frame.start * stream.row_bytes : end * stream.row_bytes]

    def land_pixels(self, frame: PixelsFrame) -> memoryview:
        """Validate a pixels frame (the next the ``open`` announced) and return the buffer its payload fills."""
        if self._result is not None:
            raise FrameAfterClose("pixels frame after close")
        if self.open is None:
            raise FrameOutOfOrder("pixels frame before open")
        if frame.request_id != self.open.request_id:
            raise FrameOutOfOrder(f"frame for request {frame.request_id!r} in handoff {self.open.request_id!r}")
        if self._landed == len(self._pixels):
            raise FrameOutOfOrder(f"{frame.role} {frame.index} pixels past those the open frame announced (open.edit)")
        buffer = self._pixels[self._landed]
        expected = buffer.announced
        if (frame.role, frame.index) != (expected.role, expected.index):
            raise FrameOutOfOrder(
                f"{frame.role} {frame.index} pixels where {expected.role} {expected.index} comes next (open.edit)"
            )
        if tuple(frame.shape) != expected.shape:
            raise ShapeMismatch(
                f"{frame.role} {frame.index} pixels of shape {frame.shape}, open declared {list(expected.shape)}"
            )
        self._landed += 1
        return buffer.bytes

    def _open(self, frame: OpenFrame) -> None:
        if self.open is not None:
            raise FrameOutOfOrder("second open frame")
        if frame.dtype not in ALLOWED_DTYPES:
            check_layout(frame.dtype, [0])  # raises DtypeNotAllowed
        if "cond" not in frame.streams:
            raise RowsOutOfBounds("open must declare the 'cond' stream")
        caps = self._caps
        if frame.row_width > caps.max_row_width:
            raise AllocationTooLarge(f"row width {frame.row_width} over the cap {caps.max_row_width}")
        itemsize = ALLOWED_DTYPES[frame.dtype].itemsize
        total = 0
        for name, spec in frame.streams.items():
            if spec.max_rows > caps.max_rows:
                raise AllocationTooLarge(f"{name}: {spec.max_rows} rows over the cap {caps.max_rows}")
            if spec.prompt_tokens > spec.max_rows + 1:
                raise RowsOutOfBounds(f"{name}: prompt of {spec.prompt_tokens} tokens cannot fit {spec.max_rows} rows")
            total += spec.max_rows * frame.row_width * itemsize
        announced = frame.edit.announced if frame.edit is not None else ()
        self._check_edit_caps(frame)
        total += sum(pixels.nbytes for pixels in announced)
        if total > caps.max_bytes:
            raise AllocationTooLarge(f"{total} bytes of rows and pixels over the cap {caps.max_bytes}")
        if self._check_open is not None:
            self._check_open(frame)
        dtype = ALLOWED_DTYPES[frame.dtype]
        self._streams = {
            name: _StreamBuffer(spec.max_rows, frame.row_width, dtype, self._pool)
            for name, spec in frame.streams.items()
        }
        self._pixels = [_PixelBuffer(pixels) for pixels in announced]
        self.open = frame

    def _check_edit_caps(self, frame: OpenFrame) -> None:
        """Each picture within the per-picture cap, and all of them within the per-edit one."""
        edit, caps = frame.edit, self._caps
        if edit is None:
            return
        for index, picture in enumerate(edit.pictures):
            if picture.width * picture.height > caps.max_image_pixels:
                raise AllocationTooLarge(
                    f"picture {index} of {picture.width}x{picture.height} pixels over the cap {caps.max_image_pixels}"
                )
        if edit.pixels > caps.max_edit_pixels:
            raise AllocationTooLarge(f"{edit.pixels} pixels of pictures over the cap {caps.max_edit_pixels}")

    def _close(self, frame: CloseFrame) -> None:
        opened = self.open
        if opened is None:  # pragma: no cover - accept() checks open before close
            raise FrameOutOfOrder("close frame before open")
        if set(frame.streams) != set(self._streams):
            raise RowCountMismatch(
                f"close lists streams {sorted(frame.streams)}, open declared {sorted(self._streams)}"
            )
        assembled: dict[StreamName, AssembledStream] = {}
        for name, totals in frame.streams.items():
            spec = opened.streams[name]
            assembled[name] = self._close_stream(name, self._streams[name], totals, spec.prefix_tokens)
        self._result = AssembledHandoff(open=opened, close=frame, streams=assembled, edit=self._close_edit(opened))

    def _close_edit(self, opened: OpenFrame) -> AssembledEdit | None:
        if opened.edit is None:
            return None
        missing = [f"{p.announced.role} {p.announced.index}" for p in self._pixels if not p.received]
        if missing:
            raise MissingPixels(f"close before the edit's {', '.join(missing)} pixels arrived")
        pictures = tuple(p.pixels for p in self._pixels if p.announced.role == "image")
        mask = next((p.pixels for p in self._pixels if p.announced.role == "mask"), None)
        return AssembledEdit(pictures=pictures, mask=mask, strength=opened.edit.strength)

    @staticmethod
    def _close_stream(
        name: str, stream: _StreamBuffer, totals: StreamTotals, prefix_tokens: int | None
    ) -> AssembledStream:
        n = totals.rows
        if n > len(stream.filled) or stream.received != n or 0 in stream.filled[:n]:
            raise RowCountMismatch(f"{name}: close says {n} rows, {stream.received} arrived (or with gaps)")
        ids = len(totals.token_ids) // TOKEN_ID_BYTES
        if not n <= ids <= n + 1:
            raise TokenCountMismatch(f"{name}: {ids} token ids for {n} rows (expected {n} or {n + 1})")
        row_ids = n * TOKEN_ID_BYTES
        if stream.token_ids[:row_ids] != totals.token_ids[:row_ids]:
            raise TokenCountMismatch(f"{name}: token ids in close differ from those of the rows frames")
        if totals.answer_start_index > ids:
            raise TokenCountMismatch(f"{name}: answer_start_index {totals.answer_start_index} past the sequence")
        if stream_checksum(stream.frame_checksums) != totals.checksum:
            raise ChecksumMismatch(f"{name}: checksum of the received rows does not match close")
        return AssembledStream(
            rows=stream.rows[:n],
            token_ids=token_ids_from_bytes(totals.token_ids),
            answer_start_index=totals.answer_start_index,
            prefix_tokens=prefix_tokens,
        )


class HandoffReceiver:
    """A byte stream in, an ``AssembledHandoff`` out. Any error leaves nothing allocated."""

    def __init__(
        self,
        caps: AssemblyCaps = AssemblyCaps(),
        limits: FrameLimits = FrameLimits(),  # noqa: B008 - a frozen dataclass, safe to share
        pool: RowBufferPool | None = None,
        check_open: Callable[[OpenFrame], None] | None = None,
    ) -> None:
        self.assembler = HandoffAssembler(caps, pool, check_open)
        self.reader = FrameReader(self.assembler, limits)

    def feed(self, chunk: Buffer) -> None:
        try:
            self.reader.feed(chunk)
        except Exception:
            self.assembler.release()
            raise

    def finish(self) -> AssembledHandoff:
        try:
            self.reader.finish()
            return self.assembler.result()
        except Exception:
            self.assembler.release()
            raise
