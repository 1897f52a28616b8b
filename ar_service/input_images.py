"""An edit's uploads → the pixels the DiT starts from, everything checked before anything is decoded.

Two steps. ``read_upload`` reads only the headers (``Image.open`` is lazy): each file's format must be
one OpenAI accepts (PNG, JPEG or WebP; the mask PNG only) and its width x height within
``max_input_pixels``, so a decompression bomb — a small file that declares a huge image — is refused
before a pixel of it is allocated. From the header the caller derives the output size (``size`` as
asked, or ``auto``: ``OutputSize``) and checks it against what the DiT draws, and holds the memory the
edit will need (``EditMemory``); only then is ``decode_edit`` run (in a worker thread): the image is
decoded (a truncated or corrupt file fails here), turned upright by its EXIF orientation, and resized
to the output size. The resize first reduces by whole factors (Pillow's ``reducing_gap``) so that no
filter pass spans more than a few input pixels per output pixel: without it a thin image (16,000,000 x
1 pixels, within the pixel limit) makes Lanczos allocate its weights or its intermediate pass in
proportion to the long side, hundreds of MB that no per-pixel count foresees. An upright turn swaps
width and height, which changes neither the pixel count nor what ``auto`` makes of it (it swaps the
output's sides too), so the checks made on the header hold for the decoded image.

The mask follows OpenAI: a PNG of the first image's size whose fully transparent pixels (alpha 0)
are the region to edit. It travels as one channel, 255 where the DiT repaints and 0 elsewhere.
Every refusal is a 400 naming ``image`` or ``mask`` (one whose own decoding needs more than
``ARDIT_AR_MAX_EDIT_MEMORY_BYTES`` too), or a 429 when the edits in hand already hold that much.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import PIL.Image
import PIL.ImageOps

from services.errors import ApiError, Overloaded
from shared.frames import PixelRole

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
MASK_FORMATS = ("PNG",)
# Pillow keeps RGB, RGBA and most decoded modes at 4 bytes a pixel. Bytes an input pixel may take while
# ``decode_edit`` runs, at once: the image decoded, its upright copy, its RGB conversion and its whole-
# factor reduction (at most half the pixels: 4 + 4 + 4 + 2); the mask decoded, its upright copy, as RGBA,
# its alpha and the repaint map (4 + 4 + 4 + 1 + 1).
DECODE_BYTES_PER_INPUT_PIXEL: dict[PixelRole, int] = {"image": 14, "mask": 14}
# Each of those copies also holds a pointer per row (8 bytes): 4 copies of the image, 5 of the mask. A
# 1 x 16,000,000 image holds 128 MB of pointers per copy for 64 MB of pixels. The longer side is counted,
# since the upright turn may make it the height.
DECODE_ROW_BYTES: dict[PixelRole, int] = {"image": 8 * 4, "mask": 8 * 5}
# After the whole-factor reduction Lanczos spans less than 2 x REDUCING_GAP input pixels per output pixel
# on each axis, so its intermediate pass is at most that many output-sized rows.
REDUCING_GAP = 3.0
# Bytes per output pixel: the image's intermediate pass (4 x 2 x REDUCING_GAP), its result (4) and the
# bytes taken from it (3); the mask's nearest-neighbour result and its bytes (1 + 1).
RESIZE_BYTES_PER_OUTPUT_PIXEL: dict[PixelRole, int] = {"image": 4 * 2 * int(REDUCING_GAP) + 4 + 3, "mask": 2}
# And per output row and column: the filter's weights (doubles), its support (3 for Lanczos) times twice
# the span each side, plus one.
FILTER_BYTES_PER_OUTPUT_LINE = 8 * (2 * 3 * 2 * int(REDUCING_GAP) + 1)


@dataclass(frozen=True)
class OutputSize:
    """How an edit's output size is chosen: ``requested``, or (None: ``size=auto``) the listed size whose
    shape is nearest the input's when the model lists the sizes it draws, else the input's size scaled
    down to ``max_pixels`` and rounded down to multiples of ``multiple``."""

    requested: tuple[int, int] | None
    multiple: int
    max_pixels: int
    listed: tuple[tuple[int, int], ...] | None = None

    def for_input(self, width: int, height: int) -> tuple[int, int]:
        if self.requested is not None:
            return self.requested
        if self.listed:
            # Nearest in aspect ratio, as a ratio (log): 2:1 is as far from 1:1 as 1:2 is.
            return min(self.listed, key=lambda size: abs(math.log(size[0] / size[1] * height / width)))
        scale = min(1.0, math.sqrt(self.max_pixels / (width * height)))
        m = self.multiple
        return max(m, int(width * scale) // m * m), max(m, int(height * scale) // m * m)


@dataclass(frozen=True)
class EditUpload:
    """An edit's files, their headers read and checked, nothing decoded."""

    image: PIL.Image.Image
    mask: PIL.Image.Image | None

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size

    def memory(self, width: int, height: int) -> int:
        """Bytes the edit holds at most, for an output of ``width`` x ``height``: while it is decoded and
        resized, and then the pixels sent to the DiT."""
        parts: list[PixelRole] = ["image"] if self.mask is None else ["image", "mask"]
        input_pixels = self.image.width * self.image.height
        rows = max(self.image.size)
        decoding = sum(
            input_pixels * DECODE_BYTES_PER_INPUT_PIXEL[part] + rows * DECODE_ROW_BYTES[part] for part in parts
        )
        resizing = sum(width * height * RESIZE_BYTES_PER_OUTPUT_PIXEL[part] for part in parts)
        return decoding + resizing + (width + height) * FILTER_BYTES_PER_OUTPUT_LINE


@dataclass(frozen=True)
class PicturePixels:
    """One picture as sent: RGB, row-major, ``height x width x 3``."""

    width: int
    height: int
    data: bytes


@dataclass(frozen=True)
class EditPixels:
    """An edit's pictures as sent, in order, and its mask (``height x width`` of the first picture)."""

    pictures: tuple[PicturePixels, ...]
    mask: bytes | None


class EditMemory:
    """The memory the AR's edits in hand (from their upload to their end) may hold together."""

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self.held = 0

    def hold(self, nbytes: int) -> Held:
        if nbytes > self._max:
            # Alone past the bound, it would never fit: no retry helps (an extremely thin image, mostly).
            raise _too_large(
                "image",
                f"decoding and resizing this image needs about {nbytes} bytes, more than the {self._max} all edits "
                "in hand may hold (ARDIT_AR_MAX_EDIT_MEMORY_BYTES); send it smaller or less elongated",
            )
        if self.held + nbytes > self._max:
            raise Overloaded(
                f"the edits in hand already hold {self.held} of {self._max} bytes; this one needs {nbytes}",
                code="rate_limit_exceeded",
                retry_after=1,
            )
        self.held += nbytes
        return Held(self, nbytes)


class Held:
    """One edit's share of ``EditMemory``; ``release`` is idempotent."""

    def __init__(self, memory: EditMemory, nbytes: int) -> None:
        self._memory = memory
        self._nbytes = nbytes

    def release(self) -> None:
        self._memory.held -= self._nbytes
        self._nbytes = 0


def read_upload(image: bytes, mask: bytes | None, max_input_pixels: int) -> EditUpload:
    """The files' headers, checked; nothing is decoded (cheap: it may run on the event loop)."""
    opened = _opened(image, "image", IMAGE_FORMATS, max_input_pixels)
    opened_mask = _opened(mask, "mask", MASK_FORMATS, max_input_pixels) if mask is not None else None
    if opened_mask is not None and opened_mask.size != opened.size:
        raise ApiError(
            400,
            f"the mask is {opened_mask.width}x{opened_mask.height}; it must be the image's size, "
            f"{opened.width}x{opened.height}",
            param="mask",
            code="invalid_image_size",
        )
    if opened_mask is not None and "A" not in opened_mask.getbands() and "transparency" not in opened_mask.info:
        raise ApiError(
            400,
            "the mask needs an alpha channel: its fully transparent pixels mark where to edit",
            param="mask",
            code="invalid_image_format",
        )
    return EditUpload(opened, opened_mask)


def decode_edit(upload: EditUpload, size: OutputSize) -> EditPixels:
    """The upload decoded, upright and resized to ``size``: its one picture, at the output size. Blocking: call it in
    a worker thread."""
    upright = decoded_upright(upload.image, "image")
    width, height = size.for_input(upright.width, upright.height)
    picture = PicturePixels(
        width, height, resized(upright.convert("RGB"), width, height, PIL.Image.Resampling.LANCZOS).tobytes()
    )
    if upload.mask is None:
        return EditPixels((picture,), None)
    return EditPixels((picture,), repaint_pixels(upload.mask, width, height))


def repaint_pixels(mask: PIL.Image.Image, width: int, height: int) -> bytes:
    """OpenAI's mask (its fully transparent pixels mark what to repaint) as sent: ``height x width``, 255 where the
    picture is repainted, 0 elsewhere. Blocking: it decodes the mask."""
    alpha = decoded_upright(mask, "mask").convert("RGBA").getchannel("A")
    repaint = alpha.point(lambda a: 255 if a == 0 else 0)
    return resized(repaint, width, height, PIL.Image.Resampling.NEAREST).tobytes()


def _opened(data: bytes, param: str, formats: tuple[str, ...], max_pixels: int) -> PIL.Image.Image:
    """The image's header: format and size known, nothing decoded yet."""
    try:
        # Past twice its own MAX_IMAGE_PIXELS Pillow refuses at once; ``max_pixels`` is checked below.
        image = PIL.Image.open(io.BytesIO(data), formats=formats)
    except PIL.Image.DecompressionBombError as exc:
        raise _too_large(param, str(exc)) from None
    except (OSError, ValueError) as exc:  # UnidentifiedImageError is an OSError
        raise ApiError(
            400,
            f"{param} is not a {' / '.join(f.lower() for f in formats)} image Pillow can read ({exc})",
            param=param,
            code="invalid_image_format",
        ) from None
    if image.width * image.height > max_pixels:
        raise _too_large(param, f"{param} is {image.width}x{image.height}, over the {max_pixels}-pixel limit")
    return image


def _too_large(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="image_too_large")


def decoded_upright(image: PIL.Image.Image, param: str) -> PIL.Image.Image:
    try:
        image.load()
        return PIL.ImageOps.exif_transpose(image)
    except (OSError, ValueError, SyntaxError) as exc:  # what Pillow raises for truncated and corrupt data
        raise ApiError(400, f"{param} could not be decoded: {exc}", param=param, code="invalid_image_format") from None


def resized(image: PIL.Image.Image, width: int, height: int, resample: PIL.Image.Resampling) -> PIL.Image.Image:
    if image.size == (width, height):
        return image
    return image.resize((width, height), resample, reducing_gap=REDUCING_GAP)
