"""ar_service/engine/hidden_state_engine.py: the captured layer is the setting's, one the model does not have
is refused when the service is built, before vLLM starts."""

from __future__ import annotations

import pytest

from ar_service.engine.hidden_state_engine import HiddenStateEngine
from ar_service.settings import ArSettings


def test_the_engine_captures_the_layer_the_settings_name_up_to_the_models_last():
    assert HiddenStateEngine(ArSettings()).layer == ArSettings().hidden_layer
    assert HiddenStateEngine(ArSettings(hidden_layer=30)).layer == 30


def test_a_layer_past_the_models_last_is_refused_naming_its_layer_count():
    with pytest.raises(ValueError, match="has 30 layers"):
        HiddenStateEngine(ArSettings(hidden_layer=31))
