"""The frames of one AR→DiT handoff, as typed models. HANDOFF_SPEC.md is the prose version.

A handoff is ``open``, then ``rows`` frames (any order, any split) and, for an image edit, its
``pixels`` frames, then ``close`` — or ``abort`` at any point. Each frame is one msgpack map; the
raw bytes of a ``rows`` or ``pixels`` frame travel in its ``data`` entry, which is not part of the
models below (the codec handles it, see frame_codec.py).

Receivers ignore map keys they do not know, so adding an optional field is not a breaking change;
anything else bumps ``SCHEMA_VERSION``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from shared.diffusion import DiffusionParams
from shared.errors import MalformedFrame, UnsupportedSchemaVersion
from shared.frame_types import NonNegInt, PosInt, WireModel, model_of_kind
from shared.row_recipe import MAX_LAYERS
from shared.tensor_codec import TOKEN_ID_BYTES

# Version 3 added image edits (``open.edit`` and the ``pixels`` frame); version 4 rows of several layers
# (``open.layers`` for ``open.layer``); see HANDOFF_SPEC.md.
SCHEMA_VERSION = 4

StreamName = Literal["cond", "uncond"]
# The public API's parameter each stream's text comes from: both services name it in their refusals.
PUBLIC_PARAM: dict[StreamName, str] = {"cond": "prompt", "uncond": "negative_prompt"}
# The images of an edit: the one edited (RGB) and its mask (one channel, 255 = repaint).
PixelRole = Literal["image", "mask"]
PIXEL_CHANNELS: dict[PixelRole, int] = {"image": 3, "mask": 1}
RequestId = Annotated[str, Field(min_length=1, max_length=128)]
Checksum = Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
# W3C Trace Context: version-traceid-parentid-flags in lowercase hex; later versions may append fields.
TraceParent = Annotated[
    str, Field(max_length=512, pattern=r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-[\x21-\x7e]+)?$")
]


def _whole_token_ids(data: bytes) -> bytes:
    if len(data) % TOKEN_ID_BYTES:
        raise ValueError(f"token_ids holds {TOKEN_ID_BYTES}-byte ids, got {len(data)} bytes")
    return data


# Raw little-endian uint32, like the row data (tensor_codec.py): no per-id work on either side,
# and 4 bytes an id where msgpack needs 5 for ids past 65535 (large vocabularies).
TokenIds = Annotated[bytes, AfterValidator(_whole_token_ids)]


class StreamSpec(WireModel):
    """One sequence of hidden rows: the conditional prompt, or the CFG negative prompt."""

    prompt_tokens: NonNegInt
    # Upper bound on rows (prompt + max generated - 1); the receiver allocates exactly this.
    max_rows: NonNegInt
    # Leading prompt tokens that are the AR's prompt template, not the user's text (Qwen-Image's
    # system prefix): their rows never condition the DiT. Optional on the wire (added within
    # version 2); a DiT whose adapter needs it refuses an open frame without it.
    prefix_tokens: NonNegInt | None = None

    @model_validator(mode="after")
    def _prefix_inside_prompt(self) -> StreamSpec:
        if self.prefix_tokens is not None and self.prefix_tokens > self.prompt_tokens:
            raise ValueError(f"prefix_tokens {self.prefix_tokens} is more than prompt_tokens {self.prompt_tokens}")
        return self


class EditSpec(WireModel):
    """An image edit: the handoff carries the image to start from (and a mask) in ``pixels`` frames.

    Both are ``diffusion.height`` x ``diffusion.width``: the sender resizes them to the output size.
    """

    # Fraction of the denoising schedule run from the noised input: 0 returns the input through
    # the VAE, 1 starts from pure noise (inside the mask, with one).
    strength: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
    # A ``mask`` pixels frame follows: only its nonzero pixels are repainted.
    mask: bool = False

    @property
    def roles(self) -> tuple[PixelRole, ...]:
        return ("image", "mask") if self.mask else ("image",)


class OpenFrame(WireModel):
    kind: Literal["open"] = "open"
    v: int = SCHEMA_VERSION
    request_id: RequestId
    model: Annotated[str, Field(min_length=1, max_length=256)]
    conditioning: Annotated[str, Field(min_length=1, max_length=64)]
    dtype: str
    # The width of a row: the text encoder's width times the count of ``layers`` (the key ``hidden_size`` until the
    # next schema version).
    row_width: PosInt = Field(alias="hidden_size")
    # The decoder layers each row holds side by side, in this order (``shared.row_recipe``). A DiT that knows the
    # layers it was trained on refuses others.
    layers: Annotated[list[NonNegInt], Field(min_length=1, max_length=MAX_LAYERS)]
    final_norm: bool
    # "cond" is required; "uncond" present means a CFG negative stream follows.
    streams: dict[StreamName, StreamSpec]
    diffusion: DiffusionParams
    # The W3C traceparent of the sender's handoff span: the receiver's spans join the sender's
    # trace. Optional (added within version 2); absent when the sender does not trace.
    traceparent: TraceParent | None = None
    # Present for an image edit (the ``pixels`` frames it announces follow); absent: text to image.
    edit: EditSpec | None = None


class RowsFrame(WireModel):
    kind: Literal["rows"] = "rows"
    v: int = SCHEMA_VERSION
    request_id: RequestId
    stream: StreamName
    start: NonNegInt
    count: NonNegInt
    # One id per row (tensor_codec.token_ids_to_bytes).
    token_ids: TokenIds
    dtype: str
    # [count, row_width]
    shape: Annotated[list[NonNegInt], Field(min_length=2, max_length=2)]
    # xxh3-64 of this frame's payload (see checksum.py).
    checksum: Checksum


class PixelsFrame(WireModel):
    """One image of an edit: ``height x width x channels`` uint8 in ``data``, row-major, RGB for the
    image and one channel for the mask. Exactly one per role ``open.edit`` announces."""

    kind: Literal["pixels"] = "pixels"
    v: int = SCHEMA_VERSION
    request_id: RequestId
    role: PixelRole
    # [height, width, channels]
    shape: Annotated[list[PosInt], Field(min_length=3, max_length=3)]
    # xxh3-64 of this frame's payload (see checksum.py).
    checksum: Checksum

    @property
    def nbytes(self) -> int:
        height, width, channels = self.shape
        return height * width * channels


class StreamTotals(WireModel):
    rows: NonNegInt
    # Every token of the sequence, prompt then generated. The last sampled token has no row,
    # so the stream has rows or rows + 1 token ids.
    token_ids: TokenIds
    answer_start_index: NonNegInt
    # xxh3-64 over the stream's frame checksums in row order (see checksum.py).
    checksum: Checksum


class CloseFrame(WireModel):
    kind: Literal["close"] = "close"
    v: int = SCHEMA_VERSION
    request_id: RequestId
    streams: dict[StreamName, StreamTotals]
    # Informational: the AR's prefix-cache counts and timings, for the DiT's logs; nothing
    # depends on them.
    cached_tokens: NonNegInt
    cache_creation_tokens: NonNegInt
    # AR-side timings in seconds (e.g. "ttft", "ar_total").
    timings: dict[str, float] = Field(default_factory=dict)


class AbortFrame(WireModel):
    kind: Literal["abort"] = "abort"
    v: int = SCHEMA_VERSION
    request_id: RequestId
    reason: Annotated[str, Field(max_length=1024)]


Frame = OpenFrame | RowsFrame | PixelsFrame | CloseFrame | AbortFrame
# The frames whose bytes follow their header in ``data``.
PayloadFrame = RowsFrame | PixelsFrame
_BY_KIND: dict[str, type[Frame]] = {
    "open": OpenFrame,
    "rows": RowsFrame,
    "pixels": PixelsFrame,
    "close": CloseFrame,
    "abort": AbortFrame,
}


def frame_from_header(header: object) -> Frame:
    """Validate a decoded msgpack map (without ``data``) into its frame model."""
    if not isinstance(header, dict):
        raise MalformedFrame(f"a frame is a msgpack map, got {type(header).__name__}")
    version = header.get("v")
    if version != SCHEMA_VERSION:
        raise UnsupportedSchemaVersion(
            f"schema version {version!r} is not supported (this side speaks {SCHEMA_VERSION})"
        )
    return model_of_kind(header, _BY_KIND, "frame")


def frame_header(frame: Frame) -> dict[str, Any]:
    """The msgpack map of a frame, ``data`` excluded. Keys in declaration order."""
    return frame.model_dump(mode="python", exclude_none=True)
