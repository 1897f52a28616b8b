"""Prompt text → token ids, with the template prefix length the DiT drops (none where it keeps every row).

The template is the row recipe's format string (Qwen-Image's), or the tokenizer's chat template rendered around
one user message with the recipe's arguments (Z-Image's, FLUX.2 [klein]'s), as their pipelines render it. Either
way it is one format string, applied and tokenised whole; the prefix length is the token count of everything
before ``{}``. The builder checks once that the prefix tokenises to the same ids on its own, so that count is
exact for every prompt.

A family that reads pictures (``PictureReading``) puts each picture's prompt before the user's text, one placeholder
a picture, as its pipeline does. vLLM takes that prompt and expands each placeholder to the picture's tokens; the
rows are one per expanded token, so the builder expands them too, by the count the family's image processor gives for
the picture's size (its public ``get_number_of_image_patches``, the one vLLM's processor uses), and the engine checks
that the two agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoImageProcessor, AutoTokenizer, PreTrainedTokenizerBase

from ar_service.engine.text_model import TextModel
from services.model_card import PictureReading
from shared.row_recipe import RowRecipe

# Stands for the prompt while the chat template is rendered: no chat template writes it, nor braces around it.
_PROMPT_MARK = "\x00ardit-prompt\x00"
# The token each picture's prompt holds once, where vLLM and the processor put the picture's tokens (Qwen2.5-VL's).
PICTURE_PLACEHOLDER = "<|image_pad|>"
# The tokens a Qwen VL encoder places pictures and video by (its 3-D positions start at each vision start).
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_pad|>")


@dataclass(frozen=True)
class BuiltPrompt:
    token_ids: list[int]  # one per row: each picture's placeholder expanded to its tokens
    prefix_tokens: int  # template tokens before the user's text
    # The prompt as vLLM takes it with its pictures, one placeholder a picture; None: no pictures (``token_ids``).
    engine_token_ids: list[int] | None = None
    picture_tokens: int = 0


@dataclass(frozen=True)
class PicturePrompts:
    """How a picture-reading family's prompt holds its pictures: the card's reading, and the image processor that
    says how many tokens a picture of a size takes."""

    reading: PictureReading
    image_processor: Any
    placeholder_id: int
    # The ids of the tokens that mark pictures (and video) to the encoder: the template's own, never the user's.
    vision_ids: frozenset[int]

    def tokens(self, width: int, height: int) -> int:
        processor = self.image_processor
        return int(processor.get_number_of_image_patches(height, width, {})) // int(processor.merge_size) ** 2


class PromptError(ValueError):
    """A prompt the family's template cannot hold as given (a vision token typed in its text)."""


class PromptBuilder:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        template: str,
        drops_template: bool = True,
        pictures: PicturePrompts | None = None,
        dropped_prefix: str | None = None,
    ) -> None:
        """``drops_template``: the template's rows before the prompt do not condition the DiT (``prefix_tokens``
        counts them; else it is 0), or only those of ``dropped_prefix``, the template's start, where it is given.
        ``pictures``: how prompts hold pictures, where the family reads them."""
        if template.count("{}") != 1:
            raise ValueError("the prompt template needs exactly one {}")
        self.tokenizer = tokenizer
        self.template = template
        self._drops_template = drops_template
        self.pictures = pictures
        prefix = template.split("{}")[0] if dropped_prefix is None else dropped_prefix
        if not template.split("{}")[0].startswith(prefix):
            raise ValueError("the dropped prefix is not the start of the template before its {}")
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
        pictures = None
        if text_model.pictures is not None and text_model.processor_dir is not None:
            image_processor = AutoImageProcessor.from_pretrained(str(text_model.processor_dir))
            (placeholder,) = tokenizer.encode(PICTURE_PLACEHOLDER, add_special_tokens=False)
            vision = frozenset(tokenizer.encode("".join(VISION_TOKENS), add_special_tokens=False))
            pictures = PicturePrompts(text_model.pictures, image_processor, placeholder, vision)
        return cls(tokenizer, template, rows.drops_template, pictures, rows.dropped_prefix)

    @property
    def reading(self) -> PictureReading | None:
        """How the family reads pictures, where its prompts hold them."""
        return self.pictures.reading if self.pictures is not None else None

    @property
    def prefix_tokens(self) -> int:
        """The template's leading tokens whose rows do not condition the DiT."""
        return len(self._prefix_ids) if self._drops_template else 0

    def build(self, text: str, picture_sizes: Sequence[tuple[int, int]] = ()) -> BuiltPrompt:
        """The prompt of ``text`` reading pictures of ``picture_sizes`` (width, height, as the vision tower reads
        them); ``PromptError`` where the text holds a picture placeholder of its own."""
        if not picture_sizes:
            return BuiltPrompt(self._encode(self.template.format(text)), self.prefix_tokens)
        if self.pictures is None:
            raise ValueError("this model's prompts hold no pictures")
        placeholder = self.pictures.placeholder_id
        if typed := sorted(set(self._encode(text)) & self.pictures.vision_ids):
            raise PromptError(f"the prompt holds the vision tokens {self.tokenizer.convert_ids_to_tokens(typed)}")
        ids = self._encode(self.template.format(self.pictures.reading.prompt(len(picture_sizes), text)))
        counts = iter(self.pictures.tokens(*size) for size in picture_sizes)
        expanded = [each for id in ids for each in ([id] * next(counts) if id == placeholder else [id])]
        return BuiltPrompt(expanded, self.prefix_tokens, ids, len(expanded) - len(ids) + len(picture_sizes))

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
