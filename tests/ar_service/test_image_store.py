"""The url image stores: unguessable names, bounded in count and in bytes, expiring — in this process's
memory and in a Redis every AR replica shares (a real redis-server), with the same behaviour."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator

import pytest

from ar_service.image_store import (
    ImageNamesHidden,
    ImageStore,
    ImageStoreUnavailable,
    ImageTooLargeForStore,
    MemoryImageStore,
    RedisImageStore,
    image_store,
)
from tests.support.redis_server import redis_server

StoreFactory = Callable[[int, int, float], ImageStore]


@pytest.fixture(params=["memory", "redis"])
def new_store(request: pytest.FixtureRequest) -> Iterator[StoreFactory]:
    if request.param == "memory":
        yield MemoryImageStore
        return
    with redis_server() as url:
        yield lambda capacity, max_bytes, ttl: RedisImageStore(url, capacity, max_bytes, ttl)


async def put_all(store: ImageStore, images: list[tuple[bytes, str]]) -> list[str]:
    return [await store.put(data, fmt) for data, fmt in images]  # type: ignore[arg-type]


async def found(store: ImageStore, names: list[str]) -> list[bool]:
    return [await store.get(name) is not None for name in names]


def test_an_image_comes_back_under_its_name_with_its_media_type(new_store):
    async def scenario():
        store = new_store(4, 1000, 60)
        [name] = await put_all(store, [(b"png bytes", "png")])
        assert name.startswith("img_") and name.endswith(".png") and len(name) > 24
        image = await store.get(name)
        assert image is not None and image.data == b"png bytes" and image.media_type == "image/png"
        assert await found(store, ["img_guessed.png"]) == [False]

    asyncio.run(scenario())


def test_names_are_never_reused(new_store):
    async def scenario():
        return await put_all(new_store(1000, 10**6, 60), [(b"x", "png")] * 300)

    assert len(set(asyncio.run(scenario()))) == 300


def test_the_count_is_bounded_oldest_first(new_store):
    async def scenario():
        store = new_store(3, 10**6, 60)
        return await found(store, await put_all(store, [(b"x", "jpeg")] * 5))

    assert asyncio.run(scenario()) == [False, False, True, True, True]


def test_the_bytes_are_bounded_too(new_store):
    async def scenario():
        store = new_store(100, 1000, 60)
        return await found(store, await put_all(store, [(bytes(400), "webp")] * 4))

    assert asyncio.run(scenario()) == [False, False, True, True]


def test_an_image_larger_than_the_store_is_refused(new_store):
    with pytest.raises(ImageTooLargeForStore):
        asyncio.run(put_all(new_store(4, 1000, 60), [(bytes(1001), "png")]))


def test_images_expire(new_store):
    async def scenario():
        store = new_store(4, 1000, 0.2)
        names = await put_all(store, [(b"x", "png")])
        await asyncio.sleep(0.4)
        return await found(store, names)

    assert asyncio.run(scenario()) == [False]


def test_replicas_sharing_a_redis_serve_each_others_images_under_one_bound():
    async def scenario(url):
        made_here, made_there = RedisImageStore(url, 3, 10**6, 60), RedisImageStore(url, 3, 10**6, 60)
        names = await put_all(made_here, [(b"a", "png")] * 2) + await put_all(made_there, [(b"b", "png")] * 2)
        return await found(made_there, names), await found(made_here, names)

    with redis_server() as url:
        seen_there, seen_here = asyncio.run(scenario(url))
    # Four images, three places, across both replicas: the oldest (made here) went first.
    assert seen_there == seen_here == [False, True, True, True]


def test_the_setting_chooses_the_store():
    assert isinstance(image_store(None, 4, 1000, 60), MemoryImageStore)
    assert isinstance(image_store("redis://127.0.0.1:1/0", 4, 1000, 60), RedisImageStore)


def test_a_redis_that_cannot_be_reached_is_a_store_unavailable_error_not_a_crash():
    store = RedisImageStore("redis://127.0.0.1:1/0", 4, 1000, 60)
    with pytest.raises(ImageStoreUnavailable):
        asyncio.run(store.put(b"x", "png"))
    with pytest.raises(ImageStoreUnavailable):
        asyncio.run(store.get("img_abc.png"))


def test_an_access_log_line_never_shows_an_images_name():
    name = "img_" + "A" * 24 + ".png"
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("1.2.3.4", "GET", f"/v1/images/{name}", "1.1", 200),
        None,
    )
    assert ImageNamesHidden().filter(record)
    assert name not in record.getMessage() and "/v1/images/img_<hidden>" in record.getMessage()


def test_a_key_that_floods_the_store_evicts_its_own_images_not_anothers(new_store):
    async def scenario():
        store = new_store(4, 10**6, 60)
        kept = [await store.put(b"b", "png", owner="b")]
        flood = [await store.put(b"a", "png", owner="a") for _ in range(10)]
        return await found(store, kept), await found(store, flood)

    kept, flood = asyncio.run(scenario())
    assert kept == [True]
    assert flood == [False] * 7 + [True] * 3  # a's oldest went, a holds the rest of the count


def test_a_full_store_takes_from_the_key_holding_the_most_bytes(new_store):
    async def scenario():
        store = new_store(100, 1000, 60)
        small = [await store.put(bytes(100), "png", owner="small") for _ in range(2)]
        large = [await store.put(bytes(300), "png", owner="large") for _ in range(2)]
        newcomer = [await store.put(bytes(300), "png", owner="newcomer")]  # 1,100 bytes: one must go
        return await found(store, small), await found(store, large), await found(store, newcomer)

    assert asyncio.run(scenario()) == ([True, True], [False, True], [True])


def test_every_key_storing_keeps_its_equal_share(new_store):
    async def scenario():
        store = new_store(6, 10**6, 60)
        names: dict[str, list[str]] = {"a": [], "b": [], "c": []}
        for _ in range(10):  # the three keys take turns putting far more than the store holds
            for owner, kept in names.items():
                kept.append(await store.put(owner.encode(), "png", owner=owner))
        return {owner: sum(await found(store, kept)) for owner, kept in names.items()}

    assert asyncio.run(scenario()) == {"a": 2, "b": 2, "c": 2}


def test_the_memory_store_expires_by_its_clock():
    now = [0.0]
    store = MemoryImageStore(4, 1000, 10, clock=lambda: now[0])

    async def scenario():
        names = await put_all(store, [(b"x", "png")])
        now[0] = 9.9
        before = await found(store, names)
        now[0] = 10.0
        return before, await found(store, names), len(await put_all(store, [(b"y", "png")] * 4))

    assert asyncio.run(scenario()) == ([True], [False], 4)
