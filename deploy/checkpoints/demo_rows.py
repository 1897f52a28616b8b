"""The rows a prompt conditions the DiT with, computed offline with transformers as the AR service does.

For a prompt the AR service tokenises the templated text with its ``PromptBuilder``, runs SmolLM2 and
streams one row per token of its ``hidden_layer`` (the demo model's by default), after the model's final
norm; the DiT's ``qwen_image`` adapter drops the template prefix and keeps the rest: the user's text and the
template's tail. ``PromptRows`` gives exactly those rows, so the demo DiT trains on what it is served.

The template prefix is the same for almost every prompt, so its key/value cache is computed once and shared
by every batch: only the rows after it are computed. That changes nothing but float rounding;
``tests/deploy/test_demo_rows.py`` checks these rows against what the running engine streams. A prompt that
starts with white space (the AR's default negative prompt is " ") merges into the prefix's last token
("\\n" + " " is one token), so it shares no cached prefix and runs whole.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModel
from transformers.modeling_outputs import BaseModelOutputWithPast

from ar_service.prompt_builder import PromptBuilder


class PromptRows:
    def __init__(self, model_dir: str | Path, template: str, layer: int | None) -> None:
        self.builder = PromptBuilder.from_model_dir(model_dir, template)
        # The base model without the LM head: its last_hidden_state is the last layer after the final norm.
        self.model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        last = self.model.config.num_hidden_layers
        # The AR's ``hidden_layer``: the output of decoder layer ``layer`` (1 the first; transformers'
        # hidden_states[layer]), put through the final norm as the AR's connector does; None, or the layer
        # count, is the last layer.
        self.layer = None if layer in (None, last) else layer
        self.prefix_ids = self.builder.build("").token_ids[: self.builder.prefix_tokens]
        with torch.no_grad():
            self._prefix_cache = self.model(torch.tensor([self.prefix_ids]), use_cache=True).past_key_values

    @torch.no_grad()
    def rows(self, prompts: Sequence[str], batch_size: int = 16) -> list[torch.Tensor]:
        """One float32 tensor [tokens after the template prefix, hidden] per prompt."""
        built = [self.builder.build(p) for p in prompts]
        shared = [i for i, b in enumerate(built) if b.token_ids[: b.prefix_tokens] == self.prefix_ids]
        # Batched by length, so that a batch pads little: the training captions' rows took 219 s instead of 339 s.
        shared.sort(key=lambda i: len(built[i].token_ids))
        out: dict[int, torch.Tensor] = {}
        for start in range(0, len(shared), batch_size):
            chunk = shared[start : start + batch_size]
            suffixes = [built[i].token_ids[built[i].prefix_tokens :] for i in chunk]
            out.update(zip(chunk, self._batch_rows(suffixes), strict=True))
        for i in sorted(set(range(len(built))) - set(shared)):
            hidden = self._hidden(self.model(input_ids=torch.tensor([built[i].token_ids]), **self._wanted))
            out[i] = hidden[0, built[i].prefix_tokens :].clone()
        return [out[i] for i in range(len(built))]

    def _batch_rows(self, suffixes: list[list[int]]) -> list[torch.Tensor]:
        batch, longest, prefix = len(suffixes), max(map(len, suffixes)), len(self.prefix_ids)
        # Right padding: a causal model's rows for real tokens never see the pads after them.
        ids = torch.zeros((batch, longest), dtype=torch.long)
        mask = torch.zeros((batch, prefix + longest), dtype=torch.long)
        mask[:, :prefix] = 1
        for i, suffix in enumerate(suffixes):
            ids[i, : len(suffix)] = torch.tensor(suffix)
            mask[i, prefix : prefix + len(suffix)] = 1
        cache = copy.deepcopy(self._prefix_cache)
        cache.batch_repeat_interleave(batch)
        hidden = self._hidden(
            self.model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, **self._wanted)
        )
        return [hidden[i, : len(suffix)].clone() for i, suffix in enumerate(suffixes)]

    @property
    def _wanted(self) -> dict[str, bool]:
        return {"output_hidden_states": self.layer is not None}

    def _hidden(self, output: BaseModelOutputWithPast) -> torch.Tensor:
        """The rows of ``layer``: transformers' last entry is normed already, the others are not."""
        if self.layer is None:
            assert output.last_hidden_state is not None
            return output.last_hidden_state
        assert output.hidden_states is not None
        return self.model.norm(output.hidden_states[self.layer])
