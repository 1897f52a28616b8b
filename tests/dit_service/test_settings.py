from __future__ import annotations

import pytest
from pydantic import ValidationError

from dit_service.settings import DitSettings
from services.dtype import default_dtype


def test_environment_configures_the_service(monkeypatch, tmp_path):
    monkeypatch.setenv("ARDIT_DIT_MODEL_DIR", str(tmp_path))
    monkeypatch.setenv("ARDIT_DIT_PORT", "9100")
    monkeypatch.setenv("ARDIT_DIT_SPECIAL_TOKEN_IDS", "[1, 2, 3]")
    monkeypatch.setenv("ARDIT_DIT_MAX_ROWS", "100")
    monkeypatch.setenv("ARDIT_DIT_MAX_FRAME_PAYLOAD_BYTES", "4096")
    monkeypatch.setenv("ARDIT_HANDOFF_TOKEN", "shared-secret")
    settings = DitSettings()
    assert settings.model_dir == tmp_path and settings.port == 9100
    assert settings.special_token_ids == frozenset({1, 2, 3})
    assert settings.handoff_token is not None
    assert settings.handoff_token.get_secret_value() == "shared-secret"
    assert settings.assembly_caps.max_rows == 100
    assert settings.frame_limits.max_payload_bytes == 4096


def test_defaults(monkeypatch):
    monkeypatch.delenv("ARDIT_HANDOFF_TOKEN", raising=False)
    monkeypatch.setenv("ARDIT_CACHE_DIR", "/cache")
    settings = DitSettings()
    assert (settings.host, settings.port) == ("127.0.0.1", 8001)
    assert settings.handoff_token is None
    assert str(settings.model_dir) == "/cache/models/ardit-demo"
    assert settings.max_sequence_length is None  # the family's, by its card


def test_the_conditioning_rows_are_the_cards_unless_the_operator_sets_them():
    from services.model_card import QWEN_IMAGE, QWEN_IMAGE_EDIT_PLUS

    assert [DitSettings().conditioning_rows(card) for card in (QWEN_IMAGE, QWEN_IMAGE_EDIT_PLUS)] == [512, 1024]
    assert DitSettings(max_sequence_length=77).conditioning_rows(QWEN_IMAGE_EDIT_PLUS) == 77


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_dtype_follows_the_device_unless_set(device):
    assert DitSettings(device=device).torch_dtype_name == default_dtype(device)
    assert DitSettings(device=device, dtype="float16").torch_dtype_name == "float16"


def test_max_sequence_length_is_bounded_by_what_qwen_image_accepts():
    with pytest.raises(ValidationError):
        DitSettings(max_sequence_length=1025)
