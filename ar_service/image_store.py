"""Images kept for ``response_format=url``: expiring, bounded in count and in bytes, served by the AR.

A URL names an unguessable random id (144 bits) and is a capability: whoever holds it may fetch
the image without an API key (as with OpenAI's own image URLs). The store is cachetools' TTL
cache sized in bytes (each image is charged its length), holding at most ``capacity`` images:
when either bound is reached, the least recently used image goes first. An expired id is simply
not found.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from cachetools import TTLCache
from starlette.convertors import Convertor, register_url_convertor

from shared.diffusion import MEDIA_TYPES, OutputFormat

# What an image's URL ends in: its id (``img_`` and 144 random bits, URL-safe base64) and its format.
IMAGE_NAME = r"img_[A-Za-z0-9_-]{24}\.(?:" + "|".join(MEDIA_TYPES) + ")"


class ImageName(Convertor[str]):
    """A path segment that is an image's name and nothing else, so ``GET /v1/images/generations`` is the
    generations route with the wrong method (405), not an image that is not there."""

    regex = IMAGE_NAME

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("image_name", ImageName())


@dataclass(frozen=True)
class StoredImage:
    data: bytes
    output_format: OutputFormat

    @property
    def media_type(self) -> str:
        return MEDIA_TYPES[self.output_format]


class ImageTooLargeForStore(ValueError):
    """One image is larger than the whole store."""


class ImageStore:
    def __init__(self, capacity: int, max_bytes: int, ttl_seconds: float) -> None:
        self.max_bytes = max_bytes
        self._capacity = capacity
        self._images: TTLCache[str, StoredImage] = TTLCache(
            maxsize=max_bytes, ttl=ttl_seconds, getsizeof=lambda image: len(image.data)
        )

    def put(self, data: bytes, output_format: OutputFormat) -> str:
        """Keep an image; its file name (id and extension) for the URL."""
        if len(data) > self.max_bytes:
            raise ImageTooLargeForStore(f"an image of {len(data)} bytes is over the store's {self.max_bytes}")
        image_id = f"img_{secrets.token_urlsafe(18)}"
        self._images.expire()
        while len(self._images) >= self._capacity:
            self._images.popitem()
        self._images[image_id] = StoredImage(data, output_format)
        return f"{image_id}.{output_format}"

    def get(self, name: str) -> StoredImage | None:
        image_id, _, _ = name.partition(".")
        return self._images.get(image_id)

    def __len__(self) -> int:
        self._images.expire()
        return len(self._images)

    @property
    def stored_bytes(self) -> int:
        self._images.expire()
        return int(self._images.currsize)
