"""Typed rejections of the handoff contract.

Every way a handoff can be refused has its own class with a stable ``code`` string, so the receiver
can answer with a precise 4xx and the sender's logs and metrics can name the reason.
``status`` is the HTTP status the DiT service answers with; ``param``, where there is one, names
the public API parameter at fault (``size``, ``n``, ``prompt``...), so the AR can pass it through.
"""

from __future__ import annotations


class HandoffError(Exception):
    """A handoff stream violated the contract. ``code`` is stable and machine-readable."""

    code = "handoff_error"
    status = 400

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class MalformedFrame(HandoffError):
    """Not a msgpack map, a field is missing, or a field has the wrong type."""

    code = "malformed_frame"


class UnsupportedSchemaVersion(HandoffError):
    code = "unsupported_schema_version"


class UnknownFrameKind(HandoffError):
    code = "unknown_frame_kind"


class DtypeNotAllowed(HandoffError):
    code = "dtype_not_allowed"


class ShapeMismatch(HandoffError):
    """Declared shape disagrees with the byte length, the hidden size or the row count."""

    code = "shape_mismatch"


class RowsOutOfBounds(HandoffError):
    """Rows outside ``[0, max_rows)`` of their stream, or a stream that was not opened."""

    code = "rows_out_of_bounds"


class OverlappingRows(HandoffError):
    """A row index arrived twice (duplicate or overlapping ``rows`` frames)."""

    code = "overlapping_rows"


class TokenCountMismatch(HandoffError):
    """Token ids do not match the rows they label, or ``close`` disagrees with the rows received."""

    code = "token_count_mismatch"


class RowCountMismatch(HandoffError):
    """``close`` declares a row count that differs from the rows that actually arrived."""

    code = "row_count_mismatch"


class MissingPixels(HandoffError):
    """``close`` came before every image ``open.edit`` announced (image, mask) arrived."""

    code = "missing_pixels"


class ChecksumMismatch(HandoffError):
    code = "checksum_mismatch"


class FrameOutOfOrder(HandoffError):
    """A frame that cannot come at this point: anything before ``open``, a second ``open``."""

    code = "frame_out_of_order"


class FrameAfterClose(HandoffError):
    code = "frame_after_close"


class FrameTooLarge(HandoffError):
    """A frame (or its header) is larger than the receiver's configured limit."""

    code = "frame_too_large"
    status = 413


class AllocationTooLarge(HandoffError):
    """The ``open`` frame asks for a row buffer over the receiver's cap (rows x hidden x dtype)."""

    code = "allocation_too_large"
    status = 413


class HandoffAborted(HandoffError):
    """The sender ended the handoff with an ``abort`` frame."""

    code = "aborted_by_sender"
    status = 409


class IncompleteStream(HandoffError):
    """The byte stream ended before a ``close`` frame (or inside a frame)."""

    code = "incomplete_stream"


# What a receiver refuses beyond the frames themselves: a stalled or endless body, rows that cannot
# condition it, parameters it cannot render. The AR passes the last three on to its client as 400s.


class HandoffStalled(HandoffError):
    """No bytes arrived for longer than the stall timeout."""

    code = "handoff_stalled"
    status = 408


class HandoffDeadlineExceeded(HandoffError):
    """The handoff took longer than the deadline from its first byte to close (a trickling sender)."""

    code = "handoff_deadline_exceeded"
    status = 408


class ConditioningMismatch(HandoffError):
    """The hidden states cannot condition this DiT: wrong width, adapter, AR model or layer."""

    code = "conditioning_mismatch"
    status = 422


class PromptTooLong(HandoffError):
    """More conditioning rows than the DiT takes (``max_sequence_length``)."""

    code = "prompt_too_long"
    status = 422


class EmptyConditioning(HandoffError):
    """The adapter selected no rows: the prompt is entirely template prefix or special tokens."""

    code = "empty_conditioning"
    status = 422


class InvalidDiffusionParams(HandoffError):
    """A diffusion parameter outside what the DiT announced it can render exactly (diffusers would
    round it or fail): ``DiffusionLimits.check``."""

    code = "invalid_diffusion_params"
    status = 422
