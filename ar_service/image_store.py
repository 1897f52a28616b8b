"""Images kept for ``response_format=url``: expiring, bounded in count and in bytes, served by the AR.

A URL names an unguessable random id (144 bits) and is a capability: whoever holds it may fetch
the image without an API key (as with OpenAI's own image URLs). Two stores keep them under the same
bounds (``ARDIT_AR_IMAGE_STORE_*``): ``MemoryImageStore`` in this process (one AR), and
``RedisImageStore`` in a Redis every AR replica shares, so a URL works whichever replica the gateway
sends its GET to. When a bound is reached the oldest image goes first; an expired id is not found.
"""

from __future__ import annotations

import logging
import re
import secrets
from dataclasses import dataclass
from typing import Protocol

from cachetools import TTLCache
from redis.asyncio import Redis
from redis.exceptions import RedisError
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


class ImageNamesHidden(logging.Filter):
    """Masks url images' names in log lines (uvicorn's access log names each request's path): a name
    is the image's credential."""

    _NAME = re.compile(IMAGE_NAME)

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self._NAME.sub("img_<hidden>", a) if isinstance(a, str) else a for a in record.args)
        return True


@dataclass(frozen=True)
class StoredImage:
    data: bytes
    output_format: OutputFormat

    @property
    def media_type(self) -> str:
        return MEDIA_TYPES[self.output_format]


class ImageTooLargeForStore(ValueError):
    """One image is larger than the whole store."""


class ImageStoreUnavailable(RuntimeError):
    """The shared store cannot be reached."""


class ImageStore(Protocol):
    max_bytes: int

    async def put(self, data: bytes, output_format: OutputFormat) -> str:
        """Keep an image; its file name (id and extension) for the URL."""
        ...

    async def get(self, name: str) -> StoredImage | None: ...

    async def aclose(self) -> None: ...


def _new_name(data: bytes, max_bytes: int, output_format: OutputFormat) -> tuple[str, str]:
    if len(data) > max_bytes:
        raise ImageTooLargeForStore(f"an image of {len(data)} bytes is over the store's {max_bytes}")
    image_id = f"img_{secrets.token_urlsafe(18)}"
    return image_id, f"{image_id}.{output_format}"


class MemoryImageStore:
    """cachetools' TTL cache sized in bytes (each image is charged its length), at most ``capacity`` images."""

    def __init__(self, capacity: int, max_bytes: int, ttl_seconds: float) -> None:
        self.max_bytes = max_bytes
        self._capacity = capacity
        self._images: TTLCache[str, StoredImage] = TTLCache(
            maxsize=max_bytes, ttl=ttl_seconds, getsizeof=lambda image: len(image.data)
        )

    async def put(self, data: bytes, output_format: OutputFormat) -> str:
        image_id, name = _new_name(data, self.max_bytes, output_format)
        self._images.expire()
        while len(self._images) >= self._capacity:
            self._images.popitem()
        self._images[image_id] = StoredImage(data, output_format)
        return name

    async def get(self, name: str) -> StoredImage | None:
        image_id, _, _ = name.partition(".")
        return self._images.get(image_id)

    async def aclose(self) -> None:
        self._images.clear()


# One Lua script, so every replica's put sees and keeps the bounds atomically: drop what expired,
# then the oldest images while a new one would pass the count or the byte bound, then add it. Every
# key carries the ``{ardit}`` hash tag, so on a Redis Cluster they all live in one slot.
_PUT = """
local index, sizes, total, last = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local id, data, fmt, prefix = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local ttl_ms, capacity, max_bytes = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local clock = redis.call('TIME')
-- Microseconds, never the same twice: images put within one tick keep their order.
local now_us = math.max(tonumber(clock[1]) * 1000000 + tonumber(clock[2]), tonumber(redis.call('GET', last) or '0') + 1)
redis.call('SET', last, now_us)
local function drop(member)
  redis.call('DECRBY', total, tonumber(redis.call('HGET', sizes, member) or '0'))
  redis.call('HDEL', sizes, member)
  redis.call('ZREM', index, member)
  redis.call('DEL', prefix .. member)
end
for _, member in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', now_us - ttl_ms * 1000)) do drop(member) end
while redis.call('ZCARD', index) >= capacity or tonumber(redis.call('GET', total) or '0') + #data > max_bytes do
  local oldest = redis.call('ZRANGE', index, 0, 0)[1]
  if not oldest then break end
  drop(oldest)
end
redis.call('HSET', prefix .. id, 'data', data, 'format', fmt)
redis.call('PEXPIRE', prefix .. id, ttl_ms)
redis.call('ZADD', index, now_us, id)
redis.call('HSET', sizes, id, #data)
redis.call('INCRBY', total, #data)
return 1
"""


class RedisImageStore:
    """Images in a Redis the replicas share, each under its own key with the store's TTL (Redis expires
    it); an index of (id, time) and sizes keeps the count and byte bounds across replicas."""

    PREFIX = "{ardit}:image:"
    KEYS = ("{ardit}:images", "{ardit}:image-sizes", "{ardit}:image-bytes", "{ardit}:image-clock")

    def __init__(self, url: str, capacity: int, max_bytes: int, ttl_seconds: float) -> None:
        self.max_bytes = max_bytes
        self._capacity = capacity
        self._ttl_ms = max(1, round(ttl_seconds * 1000))
        self._redis = Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
        self._put = self._redis.register_script(_PUT)

    async def put(self, data: bytes, output_format: OutputFormat) -> str:
        image_id, name = _new_name(data, self.max_bytes, output_format)
        args: list[bytes | str | int] = [
            image_id,
            data,
            output_format,
            self.PREFIX,
            self._ttl_ms,
            self._capacity,
            self.max_bytes,
        ]
        try:
            await self._put(keys=list(self.KEYS), args=args)
        except RedisError as exc:
            raise ImageStoreUnavailable(f"the image store cannot keep the image: {type(exc).__name__}") from None
        return name

    async def get(self, name: str) -> StoredImage | None:
        image_id, _, _ = name.partition(".")
        try:
            data, stored_format = await self._redis.hmget(self.PREFIX + image_id, ["data", "format"])
        except RedisError as exc:
            raise ImageStoreUnavailable(f"the image store cannot be read: {type(exc).__name__}") from None
        output_format = stored_format.decode() if isinstance(stored_format, bytes) else None
        if not isinstance(data, bytes) or output_format not in MEDIA_TYPES:
            return None
        return StoredImage(data, output_format)

    async def aclose(self) -> None:
        await self._redis.aclose()


def image_store(url: str | None, capacity: int, max_bytes: int, ttl_seconds: float) -> ImageStore:
    """The store ``ARDIT_AR_IMAGE_STORE_URL`` names: Redis when set, else this process's memory."""
    if url:
        return RedisImageStore(url, capacity, max_bytes, ttl_seconds)
    return MemoryImageStore(capacity, max_bytes, ttl_seconds)
