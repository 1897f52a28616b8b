"""Qwen3-VL's language model as a vLLM text model (see ``text_towers``): a Qwen3 decoder over the checkpoint's
``text_config``, the vision tower's weights skipped. Qwen-Image-2.1's text encoder is a Qwen3-VL; for text alone its
interleaved M-RoPE gives every token one position in all three sections, ordinary 1-D RoPE, and its deepstack adds
nothing (it adds vision features to picture tokens only)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper

_LANGUAGE_MODEL = WeightsMapper(orig_to_new_prefix={"model.language_model.": "model.", "model.visual.": None})


class Qwen3VLTextTower(Qwen3ForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights, mapper=_LANGUAGE_MODEL)
