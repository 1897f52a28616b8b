"""Prompt text → token ids, with the template prefix length the DiT drops.

The template is applied as a format string and tokenised whole (as Qwen-Image does), then the
prefix length is the token count of everything before ``{}``. The builder checks once that
the prefix tokenises to the same ids on its own, so that count is exact for every prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from ar_service.engine.text_model import TextModel


@dataclass(frozen=True)
class BuiltPrompt:
    token_ids: list[int]
    prefix_tokens: int  # template tokens before the user's text


class PromptBuilder:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str) -> None:
        if template.count("{}") != 1:
            raise ValueError("the prompt template needs exactly one {}")
        self.tokenizer = tokenizer
        self.template = template
        prefix = template.split("{}")[0]
        self._prefix_ids = self._encode(prefix)
        probe = self._encode(template.format("probe"))
        if probe[: len(self._prefix_ids)] != self._prefix_ids:
            raise ValueError("the template prefix does not tokenise the same on its own; end it at a token boundary")

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, template: str) -> PromptBuilder:
        """The builder of the AR model folder's tokenizer (either layout ``TextModel`` reads)."""
        tokenizer_dir = TextModel.read(Path(model_dir)).tokenizer_dir
        return cls(AutoTokenizer.from_pretrained(str(tokenizer_dir)), template)

    @property
    def prefix_tokens(self) -> int:
        return len(self._prefix_ids)

    def build(self, text: str) -> BuiltPrompt:
        return BuiltPrompt(self._encode(self.template.format(text)), self.prefix_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))
