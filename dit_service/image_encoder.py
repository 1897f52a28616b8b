"""PIL image → an encoded image file in one of the output formats (PNG, JPEG, WebP)."""

from __future__ import annotations

import io
from typing import get_args

import PIL.features
import PIL.Image

from shared.diffusion import OutputFormat

# OpenAI's default output_compression; as OpenAI uses it, higher keeps more quality.
DEFAULT_QUALITY = 100


class ImageEncoder:
    @staticmethod
    def supported() -> list[OutputFormat]:
        """The output formats this Pillow build writes (WebP is an optional feature)."""
        return [f for f in get_args(OutputFormat) if f != "webp" or PIL.features.check("webp")]

    def encode(self, image: PIL.Image.Image, output_format: OutputFormat, output_compression: int | None) -> bytes:
        """``output_compression`` (0-100) sets JPEG/WebP quality; PNG is lossless and ignores it. Every picture is
        opaque (``opaque``)."""
        image = opaque(image)
        buffer = io.BytesIO()
        # Pillow's format names are the output formats' own, upper-cased.
        if output_format == "png":
            image.save(buffer, format="PNG")
        else:
            quality = DEFAULT_QUALITY if output_compression is None else output_compression
            image.convert("RGB").save(buffer, format=output_format.upper(), quality=quality)
        return buffer.getvalue()


def opaque(image: PIL.Image.Image) -> PIL.Image.Image:
    """The picture as ardit serves it, opaque: one a model draws with alpha (Qwen-Image-2.1's VAE decodes RGBA) over
    white, as its pipeline flattens a picture with alpha for its vision encoder, so that every output format and
    ``background`` (``auto`` and ``opaque``; ``transparent`` is refused) give the same pixels."""
    if image.mode != "RGBA":
        return image
    white = PIL.Image.new("RGB", image.size, (255, 255, 255))
    white.paste(image, mask=image.getchannel("A"))
    return white
