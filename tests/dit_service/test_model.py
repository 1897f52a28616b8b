from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_facts_describe_the_tiny_checkpoint(tiny_model):
    facts = tiny_model.facts
    assert facts.row_width == 576
    assert facts.size_multiple == 16
    # Qwen-Image's shift_terminal makes a one-step schedule NaN.
    assert facts.min_inference_steps == 2


def test_each_pipeline_has_its_own_scheduler_over_shared_weights(tiny_model):
    one, other = tiny_model.new_pipeline(), tiny_model.new_pipeline()
    assert one.scheduler is not other.scheduler
    assert one.scheduler.config == other.scheduler.config
    assert one.transformer is other.transformer is tiny_model.transformer
    assert one.vae is other.vae is tiny_model.vae.module
