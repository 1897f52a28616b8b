"""PIL image → PNG / JPEG / WebP file bytes."""

from __future__ import annotations

import io

import PIL.features
import PIL.Image

from shared.frames import OutputFormat

_PIL_FORMATS: dict[str, str] = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
# OpenAI's default output_compression; as OpenAI uses it, higher keeps more quality.
DEFAULT_QUALITY = 100


class ImageEncoder:
    @staticmethod
    def supports(output_format: str) -> bool:
        if output_format not in _PIL_FORMATS:
            return False
        return output_format != "webp" or bool(PIL.features.check("webp"))

    def encode(self, image: PIL.Image.Image, output_format: OutputFormat, output_compression: int | None) -> bytes:
        """``output_compression`` (0-100) sets JPEG/WebP quality; PNG is lossless and ignores it."""
        buffer = io.BytesIO()
        if output_format == "png":
            image.save(buffer, format="PNG")
        else:
            quality = DEFAULT_QUALITY if output_compression is None else output_compression
            image.convert("RGB").save(buffer, format=_PIL_FORMATS[output_format], quality=quality)
        return buffer.getvalue()
