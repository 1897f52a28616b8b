"""The AR's settings as a user gets them without setting anything."""

from __future__ import annotations

from urllib.parse import urlsplit

from ar_service.settings import ArSettings


def test_kv_events_are_off_and_would_bind_loopback_only_unless_an_operator_says_otherwise(monkeypatch):
    for name in ("ARDIT_AR_KV_EVENTS_PUBLISHER", "ARDIT_AR_KV_EVENTS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    settings = ArSettings()
    assert settings.kv_events_publisher == "off"
    # The events carry every user's prompt token ids: never on all interfaces by default.
    assert urlsplit(settings.kv_events_endpoint).hostname == "127.0.0.1"
