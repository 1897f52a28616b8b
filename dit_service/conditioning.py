"""Conditioning adapters: which received hidden rows condition the DiT, and in what order.

An adapter picks row indices from each assembled stream; everything after that is common:
gather the rows (still in the wire dtype), cast to the model dtype, right-pad to the bucket length
with a 0/1 mask (valid rows first: diffusers then renders what it renders for the trimmed rows, up
to float rounding in the masked attention). The result is always a fresh tensor, so the handoff's
row buffer can be released right after.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from shared.errors import ConditioningMismatch, EmptyConditioning, PromptTooLong
from shared.frames import PUBLIC_PARAM, StreamName
from shared.handoff_assembler import AssembledHandoff, AssembledStream


@dataclass(frozen=True)
class ConditioningOptions:
    special_token_ids: frozenset[int]
    image_token_start_id: int | None
    max_sequence_length: int
    pad_to_multiple: int
    dtype: torch.dtype


@dataclass(frozen=True)
class Conditioning:
    """What QwenImagePipeline takes instead of a prompt. Shapes [1, L, hidden] and [1, L]."""

    prompt_embeds: torch.Tensor
    prompt_embeds_mask: torch.Tensor
    negative_prompt_embeds: torch.Tensor | None = None
    negative_prompt_embeds_mask: torch.Tensor | None = None


class ConditioningAdapter(ABC):
    name: ClassVar[str]

    def __init__(self, options: ConditioningOptions) -> None:
        self.options = options

    @abstractmethod
    def row_indices(self, stream: AssembledStream) -> list[int]:
        """Indices of the rows that condition the DiT, in the order it sees them."""

    def select(self, handoff: AssembledHandoff) -> Conditioning:
        embeds, mask = self._embeds("cond", handoff.streams["cond"])
        uncond = handoff.streams.get("uncond")
        if uncond is None:
            return Conditioning(embeds, mask)
        negative, negative_mask = self._embeds("uncond", uncond)
        return Conditioning(embeds, mask, negative, negative_mask)

    def _prompt_rows(self, stream: AssembledStream) -> range:
        # Rows before answer_start_index are the prompt; the template prefix (the open frame's
        # prefix_tokens, required by OpenFramePolicy) never conditions the DiT.
        if stream.prefix_tokens is None:
            raise ConditioningMismatch(f"{self.name} needs the streams' prefix_tokens", param="prefix_tokens")
        end = min(stream.answer_start_index, stream.rows.shape[0])
        return range(min(stream.prefix_tokens, end), end)

    def _embeds(self, name: StreamName, stream: AssembledStream) -> tuple[torch.Tensor, torch.Tensor]:
        indices = self.row_indices(stream)
        count, limit = len(indices), self.options.max_sequence_length
        if count == 0:
            raise EmptyConditioning(
                f"{self.name}: no rows of the {name!r} stream condition the DiT", param=PUBLIC_PARAM[name]
            )
        if count > limit:
            raise PromptTooLong(
                f"{PUBLIC_PARAM[name]} too long for the DiT ({count} > {limit} rows)", param=PUBLIC_PARAM[name]
            )
        multiple = self.options.pad_to_multiple
        length = min(-(-count // multiple) * multiple, limit)
        selected = stream.rows.index_select(0, torch.tensor(indices, dtype=torch.long)).to(self.options.dtype)
        embeds = selected.new_zeros((1, length, selected.shape[1]))
        embeds[0, :count] = selected
        mask = torch.zeros((1, length), dtype=torch.long)
        mask[0, :count] = 1
        return embeds, mask


class QwenImageAdapter(ConditioningAdapter):
    """Qwen-Image: the prompt's rows after the template prefix (the DiT was trained on exactly those)."""

    name = "qwen_image"

    def row_indices(self, stream: AssembledStream) -> list[int]:
        return list(self._prompt_rows(stream))


class EveryRowAdapter(ConditioningAdapter):
    """Z-Image, FLUX.2 [klein]: every row of the prompt, its chat template's included (their ``encode_prompt``
    keeps every unpadded row)."""

    name = "every_row"

    def row_indices(self, stream: AssembledStream) -> list[int]:
        return list(range(min(stream.answer_start_index, stream.rows.shape[0])))


class ArGeneratedAdapter(ConditioningAdapter):
    """MammothModa2-style: prompt text rows (no prefix, no special tokens), then the generated rows."""

    name = "ar_generated"

    def row_indices(self, stream: AssembledStream) -> list[int]:
        ids, special = stream.token_ids, self.options.special_token_ids
        text = [i for i in self._prompt_rows(stream) if ids[i] not in special]
        image_start = self.options.image_token_start_id
        generated = range(stream.answer_start_index, stream.rows.shape[0])
        image = [i for i in generated if image_start is None or ids[i] >= image_start]
        return text + image


class ConditioningAdapters:
    """The adapters an ``open`` frame may name in ``conditioning``."""

    KINDS: ClassVar[tuple[type[ConditioningAdapter], ...]] = (QwenImageAdapter, EveryRowAdapter, ArGeneratedAdapter)

    def __init__(self, options: ConditioningOptions) -> None:
        self._by_name = {kind.name: kind(options) for kind in self.KINDS}

    @classmethod
    def names(cls) -> list[str]:
        return [kind.name for kind in cls.KINDS]

    def get(self, name: str) -> ConditioningAdapter:
        adapter = self._by_name.get(name)
        if adapter is None:
            raise ConditioningMismatch(
                f"unknown conditioning adapter {name!r} (this DiT knows {sorted(self._by_name)})", param="conditioning"
            )
        return adapter
