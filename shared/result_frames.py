"""The DiT's answer on the same HTTP exchange: a stream of msgpack maps, as the handoff is.

``partial_image`` frames (previews, optional) come first, then one ``image`` frame per rendered
image, then ``done`` with the DiT's stage timings. An ``error`` frame ends the stream early when
something fails after the response has started (before that, the DiT answers a plain 4xx/5xx).
Images are encoded files (PNG/JPEG/WebP) in a msgpack ``bin``. ``progress`` frames come whenever
the DiT has sent nothing for a while (queued, or a long step): the AR reads silence longer than
its stall timeout as a frozen DiT, not as a slow render.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Literal

import msgpack
from pydantic import Field

from shared.diffusion import OutputFormat
from shared.errors import MalformedFrame
from shared.frame_types import NonNegInt, WireModel, model_of_kind
from shared.frames import RequestId

RESULT_MEDIA_TYPE = "application/vnd.ardit.result+msgpack"
HANDOFF_MEDIA_TYPE = "application/vnd.ardit.handoff+msgpack"
# Where a sender reserves a place before its handoff, and the header its handoff names it in (HANDOFF_SPEC.md).
RESERVATIONS_PATH = "/v1/handoff/reservations"
RESERVATION_HEADER = "x-ardit-reservation"


class PartialImageFrame(WireModel):
    kind: Literal["partial_image"] = "partial_image"
    request_id: RequestId
    image_index: NonNegInt
    partial_image_index: NonNegInt
    step: NonNegInt
    output_format: OutputFormat
    data: bytes


class ImageFrame(WireModel):
    kind: Literal["image"] = "image"
    request_id: RequestId
    image_index: NonNegInt
    seed: NonNegInt
    width: Annotated[int, Field(gt=0)]
    height: Annotated[int, Field(gt=0)]
    output_format: OutputFormat
    data: bytes


class ProgressFrame(WireModel):
    kind: Literal["progress"] = "progress"
    request_id: RequestId
    # Denoising steps finished so far, over all images (0 while queued), of ``steps`` in all.
    step: NonNegInt
    steps: NonNegInt


class DoneFrame(WireModel):
    kind: Literal["done"] = "done"
    request_id: RequestId
    # DiT stage timings in seconds: queue, denoise, vae_decode, encode, total (and handoff).
    timings: dict[str, float] = Field(default_factory=dict)


class ErrorFrame(WireModel):
    kind: Literal["error"] = "error"
    request_id: RequestId
    status: int
    code: str
    message: str


ResultFrame = PartialImageFrame | ImageFrame | ProgressFrame | DoneFrame | ErrorFrame
_BY_KIND: dict[str, type[ResultFrame]] = {
    "partial_image": PartialImageFrame,
    "image": ImageFrame,
    "progress": ProgressFrame,
    "done": DoneFrame,
    "error": ErrorFrame,
}


def encode_result(frame: ResultFrame) -> bytes:
    packed: bytes = msgpack.packb(frame.model_dump(mode="python"), use_bin_type=True)
    return packed


def result_from_map(obj: object) -> ResultFrame:
    if not isinstance(obj, dict):
        raise MalformedFrame("a result frame is a msgpack map")
    return model_of_kind(obj, _BY_KIND, "result frame")


class ResultReader:
    """Incremental decoder for the result stream (images are small; plain msgpack suffices)."""

    def __init__(self, max_frame_bytes: int = 256 << 20) -> None:
        self._unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=max_frame_bytes)

    def feed(self, chunk: bytes) -> Iterator[ResultFrame]:
        self._unpacker.feed(chunk)
        for obj in self._unpacker:
            yield result_from_map(obj)
