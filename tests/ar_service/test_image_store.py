"""The url image store: unguessable names, bounded in count and in bytes, expiring."""

from __future__ import annotations

import time

import pytest

from ar_service.image_store import ImageStore, ImageTooLargeForStore


def test_an_image_comes_back_under_its_name_with_its_media_type():
    store = ImageStore(capacity=4, max_bytes=1000, ttl_seconds=60)
    name = store.put(b"png bytes", "png")
    assert name.startswith("img_") and name.endswith(".png") and len(name) > 24
    image = store.get(name)
    assert image is not None and image.data == b"png bytes" and image.media_type == "image/png"
    assert store.get("img_guessed.png") is None


def test_names_are_never_reused():
    store = ImageStore(capacity=1000, max_bytes=10**6, ttl_seconds=60)
    assert len({store.put(b"x", "png") for _ in range(500)}) == 500


def test_the_count_is_bounded_oldest_first():
    store = ImageStore(capacity=3, max_bytes=10**6, ttl_seconds=60)
    names = [store.put(b"x", "jpeg") for _ in range(5)]
    assert len(store) == 3
    assert [store.get(n) is not None for n in names] == [False, False, True, True, True]


def test_the_bytes_are_bounded_too():
    store = ImageStore(capacity=100, max_bytes=1000, ttl_seconds=60)
    names = [store.put(bytes(400), "webp") for _ in range(4)]
    assert store.stored_bytes <= 1000 and len(store) == 2
    assert store.get(names[0]) is None and store.get(names[-1]) is not None


def test_an_image_larger_than_the_store_is_refused():
    with pytest.raises(ImageTooLargeForStore):
        ImageStore(capacity=4, max_bytes=1000, ttl_seconds=60).put(bytes(1001), "png")


def test_images_expire():
    store = ImageStore(capacity=4, max_bytes=1000, ttl_seconds=0.05)
    name = store.put(b"x", "png")
    time.sleep(0.1)
    assert store.get(name) is None and len(store) == 0
