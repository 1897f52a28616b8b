"""The frames of one AR→DiT handoff, as typed models. HANDOFF_SPEC.md is the prose version.

A handoff is ``open``, then ``rows`` frames (any order, any split) and, for an image edit, its
``pixels`` frames, then ``close`` — or ``abort`` at any point. Each frame is one msgpack map; the
raw bytes of a ``rows`` or ``pixels`` frame travel in its ``data`` entry, which is not part of the
models below (the codec handles it, see frame_codec.py).

Receivers ignore map keys they do not know, so adding an optional field is not a breaking change;
anything else bumps ``SCHEMA_VERSION``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_serializer, field_validator, model_validator

from shared.diffusion import DiffusionParams
from shared.errors import MalformedFrame, UnsupportedSchemaVersion
from shared.frame_types import NonNegInt, PosInt, WireModel, model_of_kind
from shared.row_recipe import RowRecipe
from shared.tensor_codec import TOKEN_ID_BYTES

# Version 3 added image edits (``open.edit`` and the ``pixels`` frame); version 4 rows of several layers
# (``open.layers`` for ``open.layer``); version 5 the whole row recipe (``open.rows``), the row width under its own
# name (``open.row_width``) and edits of several pictures, each at its own size; see HANDOFF_SPEC.md.
SCHEMA_VERSION = 5

StreamName = Literal["cond", "uncond"]
# The public API's parameter each stream's text comes from: both services name it in their refusals.
PUBLIC_PARAM: dict[StreamName, str] = {"cond": "prompt", "uncond": "negative_prompt"}
# The images of an edit: its pictures (RGB) and its mask (one channel, 255 = repaint).
PixelRole = Literal["image", "mask"]
PIXEL_CHANNELS: dict[PixelRole, int] = {"image": 3, "mask": 1}
# A pixels frame's place in its edit: its role and index (``PixelsFrame``).
PixelsPlace = tuple[PixelRole, int]
# Most pictures one edit may give on the wire (a DiT announces its own, fewer, ``limits.max_edit_pictures``).
MAX_PICTURES = 16
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


class PictureSpec(WireModel):
    """One picture of an edit, at its own size."""

    width: PosInt
    height: PosInt


@dataclass(frozen=True)
class AnnouncedPixels:
    """One ``pixels`` frame an edit announces: its role, its index (the picture's place in ``edit.pictures``; 0 for
    the mask) and its ``[height, width, channels]``."""

    role: PixelRole
    index: int
    shape: tuple[int, int, int]

    @property
    def nbytes(self) -> int:
        height, width, channels = self.shape
        return height * width * channels


class EditSpec(WireModel):
    """An image edit: the handoff carries its pictures (and a mask) in ``pixels`` frames, one per picture in order,
    then the mask.

    With a ``strength`` the DiT starts from the first picture noised to it (img2img; inpaint with a mask): the
    sender sends it at the output size. Without one it is a reference edit: the family's pipeline reads every picture
    beside the rows, each at its own size.
    """

    pictures: Annotated[list[PictureSpec], Field(min_length=1, max_length=MAX_PICTURES)]
    # Fraction of the denoising schedule run from the noised first picture: 0 returns it through the VAE, 1 starts
    # from pure noise (inside the mask, with one). None: a reference edit, whose pipeline takes no strength.
    strength: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    # A ``mask`` pixels frame follows, the size of the first picture: only its nonzero pixels are repainted.
    mask: bool = False

    @property
    def announced(self) -> tuple[AnnouncedPixels, ...]:
        """The ``pixels`` frames this edit announces, in the order they come."""
        pictures = tuple(
            AnnouncedPixels("image", index, (picture.height, picture.width, PIXEL_CHANNELS["image"]))
            for index, picture in enumerate(self.pictures)
        )
        if not self.mask:
            return pictures
        first = self.pictures[0]
        return (*pictures, AnnouncedPixels("mask", 0, (first.height, first.width, PIXEL_CHANNELS["mask"])))

    @property
    def pixels(self) -> int:
        """Width x height of every picture together (the mask not counted)."""
        return sum(picture.width * picture.height for picture in self.pictures)


class OpenFrame(WireModel):
    kind: Literal["open"] = "open"
    v: int = SCHEMA_VERSION
    request_id: RequestId
    model: Annotated[str, Field(min_length=1, max_length=256)]
    dtype: str
    # The width of a row: the text encoder's width times the count of ``rows.layers``.
    row_width: PosInt
    # How the rows were read from the AR's model (``shared.row_recipe``), its layers counted from the start. A DiT
    # that knows how it was trained refuses any other recipe; it conditions on the rows ``rows.conditioning`` picks.
    rows: RowRecipe
    # "cond" is required; "uncond" present means a CFG negative stream follows.
    streams: dict[StreamName, StreamSpec]
    diffusion: DiffusionParams
    # The W3C traceparent of the sender's handoff span: the receiver's spans join the sender's
    # trace. Optional (added within version 2); absent when the sender does not trace.
    traceparent: TraceParent | None = None
    # Present for an image edit (the ``pixels`` frames it announces follow); absent: text to image.
    edit: EditSpec | None = None

    @field_validator("rows")
    @classmethod
    def _layers_from_the_start(cls, rows: RowRecipe) -> RowRecipe:
        # A card may count layers from the end; the AR resolves them against its model before they travel.
        if min(rows.layers) < 0:
            raise ValueError(f"rows.layers {rows.layers} are counted from the start on the wire")
        return rows

    @field_serializer("rows")
    def _every_recipe_field(self, rows: RowRecipe) -> dict[str, Any]:
        # Every field travels, None included (frame_header leaves out the Nones of optional keys): a template of None
        # (the tokenizer's chat template) left out would be read as the default, Qwen-Image's.
        return rows.model_dump(mode="python")


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
    """One image of an edit: ``height x width x channels`` uint8 in ``data``, row-major, RGB for a picture and one
    channel for the mask. One per picture ``open.edit`` announces, in order, then the mask."""

    kind: Literal["pixels"] = "pixels"
    v: int = SCHEMA_VERSION
    request_id: RequestId
    role: PixelRole
    # The picture's place in ``open.edit.pictures``; 0 for the mask.
    index: NonNegInt
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
