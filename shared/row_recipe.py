"""How a DiT's conditioning rows are read from its text encoder: its family's ``encode_prompt``, as data.

Each diffusers family reads its LLM differently (Qwen-Image: the last layer after the final norm, its own
template, the template's rows dropped; Z-Image: the layer before the last, before the norm, the tokenizer's
chat template, every row kept; FLUX.2 [klein]: layers 9, 18 and 27 side by side). The DiT's model card holds the
recipe (``services.model_card``), the DiT announces it, the AR captures exactly that, and the DiT refuses an
``open`` that says otherwise: rows of another layer or norm have the same width and would draw a wrong picture
without any error.

A layer ``k`` is transformers' ``hidden_states[k]``: 0 the embeddings, ``k`` the output of decoder layer ``k``; in
a model card a negative ``k`` counts from the end as there (-1 the last layer), and the card resolves it against
its text encoder (``resolved``): what is announced and captured is absolute.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from shared.frame_types import WireModel

# Qwen-Image's own prompt template: its DiT was trained on the rows after the system prefix.
QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
# Qwen-Image-Edit's (QwenImageEditPlusPipeline's): the pictures' prompts and the user's text go where ``{}`` is.
QWEN_IMAGE_EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new image "
    "that meets the user's requirements while maintaining consistency with the original input where appropriate."
    "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
# Qwen-Image-2.1's (QwenImage21Pipeline's text-to-image template) and the system message its rows start after.
QWEN_IMAGE_21_SYSTEM = "<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n"
QWEN_IMAGE_21_TEMPLATE = QWEN_IMAGE_21_SYSTEM + "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
# Most layers one row may stack (FLUX.2 [klein] stacks 3).
MAX_LAYERS = 8


class RowRecipe(WireModel):
    # The layers whose outputs condition the DiT, side by side along the width in this order (a row is
    # ``len(layers)`` times the text encoder's width).
    layers: Annotated[list[int], Field(min_length=1, max_length=MAX_LAYERS)] = Field(default_factory=lambda: [-1])
    # Whether the text encoder's final norm is applied to every layer's rows.
    final_norm: bool = True
    # A prompt becomes text by this format string (one ``{}``), or where it is None by the tokenizer's chat
    # template: one user message, the generation prompt added, ``chat_template_kwargs`` passed on.
    template: Annotated[str, Field(max_length=4096)] | None = QWEN_IMAGE_TEMPLATE
    chat_template_kwargs: dict[str, bool] = Field(default_factory=dict)
    # Whether the template's rows before the prompt are left out (Qwen-Image's ``encode_prompt`` drops them; Z-Image's
    # and FLUX.2's keep every row): the AR then says where the prompt starts (``prefix_tokens``).
    drops_template: bool = True
    # Where the template's rows left out end before the prompt does: its text from the start, a prefix of the
    # template (Qwen-Image-2.1's ``encode_prompt`` drops its system message only and keeps the user turn's opening).
    # None: every row before the prompt is left out.
    dropped_prefix: Annotated[str, Field(max_length=4096)] | None = None
    # Which rows condition the DiT: the DiT's conditioning adapter of that name (``dit_service.conditioning``).
    conditioning: Annotated[str, Field(min_length=1, max_length=64)] = "qwen_image"

    def resolved(self, num_layers: int) -> RowRecipe:
        """This recipe with its layers counted from the start, for a text encoder of ``num_layers`` layers;
        ``ValueError`` naming the layer the text encoder does not have."""
        layers = [layer if layer >= 0 else num_layers + 1 + layer for layer in self.layers]
        missing = [given for given, layer in zip(self.layers, layers, strict=True) if not 0 <= layer <= num_layers]
        if missing:
            raise ValueError(f"layers {missing}: the text encoder has {num_layers} layers")
        return self.model_copy(update={"layers": layers})

    def differences(self, other: RowRecipe) -> dict[str, str]:
        """How ``other`` reads rows otherwise than this recipe: a phrase for each field that differs, by its name
        (empty: the same rows). The one comparison of two recipes, on both sides of the handoff: the AR against a
        DiT's announcement, a DiT against an ``open`` frame's ``rows``."""
        return {
            name: f"{name} {getattr(other, name)!r} (not {getattr(self, name)!r})"
            for name in type(self).model_fields
            if getattr(other, name) != getattr(self, name)
        }
