"""ar_service/engine/hidden_state_engine.py: the captured layer is the setting's, one the model does not have
is refused when the service is built, before vLLM starts; a pipeline folder's are its card's."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ar_service.engine.hidden_state_engine import HiddenStateEngine
from ar_service.settings import ArSettings


def test_the_engine_takes_any_layer_from_the_embeddings_to_the_models_last():
    assert [HiddenStateEngine(ArSettings(hidden_layer=n)).rows.layers for n in (0, 8, 30)] == [[0], [8], [30]]


def test_a_negative_layer_is_refused_by_the_settings():
    with pytest.raises(ValidationError, match="hidden_layer"):
        ArSettings(hidden_layer=-1)


def test_a_layer_past_the_models_last_is_refused_naming_its_layer_count():
    with pytest.raises(ValueError, match="has 30 layers"):
        HiddenStateEngine(ArSettings(hidden_layer=31))
