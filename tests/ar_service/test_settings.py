"""The AR's settings as a user gets them without setting anything."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from ar_service.settings import ArSettings


def test_kv_events_are_off_and_would_bind_loopback_only_unless_an_operator_says_otherwise(monkeypatch):
    for name in ("ARDIT_AR_KV_EVENTS_PUBLISHER", "ARDIT_AR_KV_EVENTS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    settings = ArSettings()
    assert settings.kv_events_publisher == "off"
    # The events carry every user's prompt token ids: never on all interfaces by default.
    assert urlsplit(settings.kv_events_endpoint).hostname == "127.0.0.1"


def test_the_engine_takes_the_longest_request_the_api_admits_unless_told_otherwise():
    settings = ArSettings()
    assert settings.model_len == settings.max_prompt_tokens + settings.max_new_tokens_limit == 1536
    assert ArSettings(max_model_len=8192).model_len == 8192


def test_the_kv_cache_holds_the_longest_request_and_one_block_for_each_other_sequence():
    settings = ArSettings()
    assert settings.kv_cache_bytes is None
    # 1,536 tokens fill 12 blocks of 128 (the CPU engine's block); the other 15 sequences one each.
    assert settings.kv_cache_tokens(128) == (12 + 15) * 128
    assert ArSettings(max_num_seqs=1, max_new_tokens_limit=1).kv_cache_tokens(128) == 9 * 128


@pytest.mark.parametrize(
    ("settings", "base"),
    [
        ({}, "http://127.0.0.1:8000"),
        ({"host": "::1", "port": 9000}, "http://[::1]:9000"),
        ({"host": "0.0.0.0"}, None),
        ({"host": "::"}, None),
        ({"host": "0.0.0.0", "public_base_url": "https://images.example.com"}, "https://images.example.com"),
    ],
)
def test_url_images_are_linked_from_the_configured_address_or_the_one_the_service_listens_on(settings, base):
    assert ArSettings(**settings).image_base_url == base
