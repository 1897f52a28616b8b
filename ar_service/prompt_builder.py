"""Prompt text → token ids, with the template prefix length the DiT drops (none where it keeps every row).

The template is the row recipe's format string (Qwen-Image's), or the tokenizer's chat template rendered around
one user message with the recipe's arguments (Z-Image's, FLUX.2 [klein]'s), as their pipelines render it. Either
way it is one format string, applied and tokenised whole; the prefix length is the token count of everything
before ``{}``. The builder checks once that the prefix tokenises to the same ids on its own, so that count is
exact for every prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from ar_service.engine.text_model import TextModel
from shared.row_recipe import RowRecipe

# Stands for the prompt while the chat template is rendered: no chat template writes it, nor braces around it.
_PROMPT_MARK = "\x00ardit-prompt\x00"


@dataclass(frozen=True)
class BuiltPrompt:
    token_ids: list[int]
    prefix_tokens: int  # template tokens before the user's text


class PromptBuilder:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str, drops_template: bool = True) -> None:
        """``drops_template``: the template's rows before the prompt do not condition the DiT (``prefix_tokens``
        counts them; else it is 0)."""
        if template.count("{}") != 1:
            raise ValueError("the prompt template needs exactly one {}")
        self.tokenizer = tokenizer
        self.template = template
        self._drops_template = drops_template
        prefix = template.split("{}")[0]
        self._prefix_ids = self._encode(prefix)
        probe = self._encode(template.format("probe"))
        if probe[: len(self._prefix_ids)] != self._prefix_ids:
            raise ValueError("the template prefix does not tokenise the same on its own; end it at a token boundary")

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, template: str) -> PromptBuilder:
        """The builder of the AR model folder's tokenizer (either layout ``TextModel`` reads), with ``template``."""
        tokenizer_dir = TextModel.read(Path(model_dir)).tokenizer_dir
        return cls(AutoTokenizer.from_pretrained(str(tokenizer_dir)), template)

    @classmethod
    def of_text_model(cls, text_model: TextModel, rows: RowRecipe) -> PromptBuilder:
        """The builder of the AR model's tokenizer (either layout ``TextModel`` reads), templating as ``rows`` says."""
        tokenizer = AutoTokenizer.from_pretrained(str(text_model.tokenizer_dir))
        template = rows.template or chat_template(tokenizer, rows.chat_template_kwargs)
        return cls(tokenizer, template, rows.drops_template)

    @property
    def prefix_tokens(self) -> int:
        """The template's leading tokens whose rows do not condition the DiT."""
        return len(self._prefix_ids) if self._drops_template else 0

    def build(self, text: str) -> BuiltPrompt:
        return BuiltPrompt(self._encode(self.template.format(text)), self.prefix_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def chat_template(tokenizer: PreTrainedTokenizerBase, arguments: dict[str, Any]) -> str:
    """The tokenizer's chat template around one user message, with the generation prompt, as a format string:
    what ZImagePipeline and Flux2KleinPipeline render a prompt with."""
    if not tokenizer.chat_template:
        raise ValueError(f"the row recipe asks for the chat template, and {tokenizer.name_or_path} has none")
    messages = [{"role": "user", "content": _PROMPT_MARK}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **arguments)
    if not isinstance(text, str) or text.count(_PROMPT_MARK) != 1:
        raise ValueError(f"the chat template of {tokenizer.name_or_path} does not render the prompt once, as it is")
    return text.replace("{", "{{").replace("}", "}}").replace(_PROMPT_MARK, "{}")
