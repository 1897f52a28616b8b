"""Images kept for ``response_format=url``: expiring, bounded in count and in bytes, served by the AR.

A URL names an unguessable random id (144 bits) and is a capability: whoever holds it may fetch
the image without an API key (as with OpenAI's own image URLs). Two stores keep them under the same
bounds (``ARDIT_AR_IMAGE_STORE_*``): ``MemoryImageStore`` in this process (one AR), and
``RedisImageStore`` in a Redis every AR replica shares, so a URL works whichever replica the gateway
sends its GET to. An expired id is not found.

Each image has an owner (the API key's tenant; one owner without keys). When a put would pass a
bound, the oldest image of the owner holding the most of that bound (images for the count, bytes for
the bytes; among equals, the oldest image of theirs) goes first: a key that floods the store evicts
its own images, never those of a key that holds less, and every key storing keeps at least its equal
share. Without keys that is oldest first.
"""

from __future__ import annotations

import itertools
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

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

    async def put(self, data: bytes, output_format: OutputFormat, owner: str = "") -> str:
        """Keep ``owner``'s image; its file name (id and extension) for the URL."""
        ...

    async def get(self, name: str) -> StoredImage | None: ...

    async def aclose(self) -> None: ...


def _new_name(data: bytes, max_bytes: int, output_format: OutputFormat) -> tuple[str, str]:
    if len(data) > max_bytes:
        raise ImageTooLargeForStore(f"an image of {len(data)} bytes is over the store's {max_bytes}")
    image_id = f"img_{secrets.token_urlsafe(18)}"
    return image_id, f"{image_id}.{output_format}"


@dataclass(frozen=True)
class _Kept:
    image: StoredImage
    owner: str
    expires_at: float
    order: int  # when it was put, among this store's images


class MemoryImageStore:
    """Each owner's images oldest first, with their expiry. (cachetools' caches evict by their own
    order across all keys, not by owner.)"""

    def __init__(
        self, capacity: int, max_bytes: int, ttl_seconds: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_bytes = max_bytes
        self._capacity = capacity
        self._ttl = ttl_seconds
        self._clock = clock
        self._by_id: dict[str, _Kept] = {}
        self._by_owner: dict[str, OrderedDict[str, int]] = {}  # owner -> image id -> bytes, oldest first
        self._owner_bytes: dict[str, int] = {}
        self._bytes = 0
        self._puts = itertools.count()

    async def put(self, data: bytes, output_format: OutputFormat, owner: str = "") -> str:
        image_id, name = _new_name(data, self.max_bytes, output_format)
        now = self._clock()
        self._expire(now)
        while len(self._by_id) >= self._capacity:
            self._drop_oldest_of(self._largest({o: len(images) for o, images in self._by_owner.items()}))
        while self._bytes + len(data) > self.max_bytes:
            self._drop_oldest_of(self._largest(self._owner_bytes))
        self._by_id[image_id] = _Kept(StoredImage(data, output_format), owner, now + self._ttl, next(self._puts))
        self._by_owner.setdefault(owner, OrderedDict())[image_id] = len(data)
        self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + len(data)
        self._bytes += len(data)
        return name

    async def get(self, name: str) -> StoredImage | None:
        image_id, _, _ = name.partition(".")
        kept = self._by_id.get(image_id)
        if kept is None or kept.expires_at <= self._clock():
            return None
        return kept.image

    async def aclose(self) -> None:
        self._by_id.clear()
        self._by_owner.clear()
        self._owner_bytes.clear()
        self._bytes = 0

    def _expire(self, now: float) -> None:
        # One TTL for all: each owner's oldest image expires first.
        for owner, images in list(self._by_owner.items()):
            while images and self._oldest(owner).expires_at <= now:
                self._drop_oldest_of(owner)

    def _largest(self, held: dict[str, int]) -> str:
        """The owner holding the most; among equals, the one whose oldest image is the oldest."""
        most = max(held.values())
        return min((o for o, h in held.items() if h == most), key=lambda o: self._oldest(o).order)

    def _oldest(self, owner: str) -> _Kept:
        return self._by_id[next(iter(self._by_owner[owner]))]

    def _drop_oldest_of(self, owner: str) -> None:
        images = self._by_owner[owner]
        image_id, size = images.popitem(last=False)
        del self._by_id[image_id]
        self._bytes -= size
        self._owner_bytes[owner] -= size
        if not images:
            del self._by_owner[owner], self._owner_bytes[owner]


# One Lua script, so every replica's put sees and keeps the bounds atomically: drop what expired,
# then, while the new image would pass the count or the byte bound, the oldest image of an owner
# holding the most of that bound (walking the time index, at most the store's count, the first image
# whose owner holds that much), then add it. Every key carries the ``{ardit}`` hash tag, so on a
# Redis Cluster they all live in one slot.
_PUT = """
local index, sizes, owners, total, last, owner_count, owner_bytes = unpack(KEYS)
local id, data, fmt, prefix, owner = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[8]
local ttl_ms, capacity, max_bytes = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local clock = redis.call('TIME')
-- Microseconds, never the same twice: images put within one tick keep their order.
local now_us = math.max(tonumber(clock[1]) * 1000000 + tonumber(clock[2]), tonumber(redis.call('GET', last) or '0') + 1)
redis.call('SET', last, now_us)
local function drop(member)
  local size = tonumber(redis.call('HGET', sizes, member) or '0')
  local holder = redis.call('HGET', owners, member) or ''
  redis.call('DECRBY', total, size)
  if tonumber(redis.call('ZINCRBY', owner_count, -1, holder)) <= 0 then
    redis.call('ZREM', owner_count, holder)
    redis.call('ZREM', owner_bytes, holder)
  else
    redis.call('ZINCRBY', owner_bytes, -size, holder)
  end
  redis.call('HDEL', sizes, member)
  redis.call('HDEL', owners, member)
  redis.call('ZREM', index, member)
  redis.call('DEL', prefix .. member)
end
local function drop_oldest_of_largest(by)
  local most = redis.call('ZREVRANGE', by, 0, 0, 'WITHSCORES')[2]
  if not most then return false end
  for _, member in ipairs(redis.call('ZRANGE', index, 0, -1)) do
    if redis.call('ZSCORE', by, redis.call('HGET', owners, member) or '') == most then
      drop(member)
      return true
    end
  end
  return false
end
for _, member in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', now_us - ttl_ms * 1000)) do drop(member) end
while redis.call('ZCARD', index) >= capacity do
  if not drop_oldest_of_largest(owner_count) then break end
end
while tonumber(redis.call('GET', total) or '0') + #data > max_bytes do
  if not drop_oldest_of_largest(owner_bytes) then break end
end
redis.call('HSET', prefix .. id, 'data', data, 'format', fmt)
redis.call('PEXPIRE', prefix .. id, ttl_ms)
redis.call('ZADD', index, now_us, id)
redis.call('HSET', sizes, id, #data)
redis.call('HSET', owners, id, owner)
redis.call('INCRBY', total, #data)
redis.call('ZINCRBY', owner_count, 1, owner)
redis.call('ZINCRBY', owner_bytes, #data, owner)
return 1
"""


class RedisImageStore:
    """Images in a Redis the replicas share, each under its own key with the store's TTL (Redis expires
    it); an index of (id, time) and sizes keeps the count and byte bounds across replicas."""

    PREFIX = "{ardit}:image:"
    KEYS = (
        "{ardit}:images",
        "{ardit}:image-sizes",
        "{ardit}:image-owners",
        "{ardit}:image-bytes",
        "{ardit}:image-clock",
        "{ardit}:image-owner-count",
        "{ardit}:image-owner-bytes",
    )

    def __init__(self, url: str, capacity: int, max_bytes: int, ttl_seconds: float) -> None:
        self.max_bytes = max_bytes
        self._capacity = capacity
        self._ttl_ms = max(1, round(ttl_seconds * 1000))
        self._redis = Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
        self._put = self._redis.register_script(_PUT)

    async def put(self, data: bytes, output_format: OutputFormat, owner: str = "") -> str:
        image_id, name = _new_name(data, self.max_bytes, output_format)
        args: list[bytes | str | int] = [
            image_id,
            data,
            output_format,
            self.PREFIX,
            self._ttl_ms,
            self._capacity,
            self.max_bytes,
            owner,
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
