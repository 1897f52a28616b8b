"""An edit's uploads → the pixels the DiT starts from, checked before anything is decoded.

Pillow reads an image's header first (``Image.open`` is lazy): its format must be one OpenAI
accepts (PNG, JPEG or WebP; the mask PNG only) and its width x height within
``max_input_pixels``, so a decompression bomb — a small file that declares a huge image — is
refused before a pixel of it is allocated. Only then is it decoded (a truncated or corrupt file
fails here), turned upright by its EXIF orientation, and resized to the output size.

The mask follows OpenAI: a PNG of the first image's size whose fully transparent pixels (alpha 0)
are the region to edit. It travels as one channel, 255 where the DiT repaints and 0 elsewhere.
Every refusal is a 400 naming ``image`` or ``mask``.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import PIL.Image
import PIL.ImageOps

from services.errors import ApiError

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
MASK_FORMATS = ("PNG",)


@dataclass(frozen=True)
class OutputSize:
    """How an edit's output size is chosen: ``requested``, or (None: ``size=auto``) the input's,
    scaled down to ``max_pixels`` and rounded down to multiples of ``multiple``."""

    requested: tuple[int, int] | None
    multiple: int
    max_pixels: int

    def for_input(self, width: int, height: int) -> tuple[int, int]:
        if self.requested is not None:
            return self.requested
        scale = min(1.0, math.sqrt(self.max_pixels / (width * height)))
        m = self.multiple
        return max(m, int(width * scale) // m * m), max(m, int(height * scale) // m * m)


@dataclass(frozen=True)
class EditPixels:
    """The image (RGB, row-major, ``height x width x 3``) and mask (``height x width``) as sent."""

    width: int
    height: int
    image: bytes
    mask: bytes | None


def decode_edit(image: bytes, mask: bytes | None, size: OutputSize, max_input_pixels: int) -> EditPixels:
    """Blocking (decoding is CPU work): call it in a worker thread."""
    opened = _opened(image, "image", IMAGE_FORMATS, max_input_pixels)
    # The mask is checked before the image is decoded: a request that will be refused costs no decode.
    opened_mask = _opened(mask, "mask", MASK_FORMATS, max_input_pixels) if mask is not None else None
    upright = _decoded(opened, "image")
    width, height = size.for_input(upright.width, upright.height)
    pixels = _resized(upright.convert("RGB"), width, height, PIL.Image.Resampling.LANCZOS)
    if opened_mask is None:
        return EditPixels(width, height, pixels.tobytes(), None)
    if opened_mask.size != upright.size:
        raise ApiError(
            400,
            f"the mask is {opened_mask.width}x{opened_mask.height}; it must be the image's size, "
            f"{upright.width}x{upright.height}",
            param="mask",
            code="invalid_image_size",
        )
    if "A" not in opened_mask.getbands() and "transparency" not in opened_mask.info:
        raise ApiError(
            400,
            "the mask needs an alpha channel: its fully transparent pixels mark where to edit",
            param="mask",
            code="invalid_image_format",
        )
    alpha = _decoded(opened_mask, "mask").convert("RGBA").getchannel("A")
    repaint = alpha.point(lambda a: 255 if a == 0 else 0)
    return EditPixels(
        width, height, pixels.tobytes(), _resized(repaint, width, height, PIL.Image.Resampling.NEAREST).tobytes()
    )


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


def _decoded(image: PIL.Image.Image, param: str) -> PIL.Image.Image:
    try:
        image.load()
        return PIL.ImageOps.exif_transpose(image)
    except (OSError, ValueError, SyntaxError) as exc:  # what Pillow raises for truncated and corrupt data
        raise ApiError(400, f"{param} could not be decoded: {exc}", param=param, code="invalid_image_format") from None


def _resized(image: PIL.Image.Image, width: int, height: int, resample: PIL.Image.Resampling) -> PIL.Image.Image:
    return image if image.size == (width, height) else image.resize((width, height), resample)
