"""Images kept for ``response_format=url``: bounded in count, expiring, served by the AR itself.

URLs name an opaque random id, never a server path; the oldest image is evicted when full.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


@dataclass(frozen=True)
class StoredImage:
    data: bytes
    output_format: str
    expires_at: float

    @property
    def media_type(self) -> str:
        return MEDIA_TYPES[self.output_format]


class ImageStore:
    def __init__(self, capacity: int, ttl_seconds: float) -> None:
        self._capacity = capacity
        self._ttl = ttl_seconds
        self._images: OrderedDict[str, StoredImage] = OrderedDict()

    def put(self, data: bytes, output_format: str) -> str:
        self._expire()
        image_id = f"img_{secrets.token_urlsafe(18)}"
        self._images[image_id] = StoredImage(data, output_format, time.monotonic() + self._ttl)
        while len(self._images) > self._capacity:
            self._images.popitem(last=False)
        return f"{image_id}.{output_format}"

    def get(self, name: str) -> StoredImage | None:
        self._expire()
        image_id, _, _ = name.partition(".")
        return self._images.get(image_id)

    def __len__(self) -> int:
        return len(self._images)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._images and next(iter(self._images.values())).expires_at <= now:
            self._images.popitem(last=False)
