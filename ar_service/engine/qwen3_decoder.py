"""transformers' ``Qwen3Model`` (a Qwen3 decoder without its LM head) as a vLLM text model (see ``text_towers``).

Z-Image ships its text encoder so: its weights have no ``model.`` prefix and there is no ``lm_head``. vLLM serves
``Qwen3Model`` only as a pooling model, which has no hidden-state capture; served as vLLM's ``Qwen3ForCausalLM``
with its prefix restored, it captures any layer. The LM head is the tied embedding (``text_only_overrides``): the
one token the AR samples is never read, only its prompt's rows.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper

_DECODER = WeightsMapper(
    orig_to_new_prefix={"embed_tokens.": "model.embed_tokens.", "layers.": "model.layers.", "norm.": "model.norm."}
)


class Qwen3Decoder(Qwen3ForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights, mapper=_DECODER)
