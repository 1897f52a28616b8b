"""Qwen2.5-VL's language model as a vLLM text model (see ``text_towers``): a Qwen2 decoder over the
checkpoint's ``text_config``, the vision tower's weights skipped under both key layouts checkpoints are
saved with."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper

_LANGUAGE_MODEL = WeightsMapper(
    orig_to_new_prefix={
        # transformers >= 4.52 may save the nested layout; older saves (and transformers 5's) the flat one.
        "model.language_model.": "model.",
        "model.visual.": None,
        "visual.": None,
    }
)


class Qwen2_5_VLTextTower(Qwen2ForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights, mapper=_LANGUAGE_MODEL)
