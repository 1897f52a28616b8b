"""Which rows condition the DiT: exact selection on hand-built sequences, and padding that changes nothing."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from dit_service.conditioning import (
    ArGeneratedAdapter,
    ConditioningAdapters,
    ConditioningOptions,
    QwenImageAdapter,
)
from dit_service.render_job import RenderJob
from shared.errors import ConditioningMismatch, EmptyConditioning, PromptTooLong
from shared.frames import CloseFrame, StreamName, StreamTotals
from shared.handoff_assembler import AssembledHandoff, AssembledStream
from shared.result_frames import ImageFrame, ResultFrame
from shared.tensor_codec import token_ids_to_bytes
from tests.dit_service.handoff_requests import open_frame, params
from tests.dit_service.test_renderer import renderer_of, run

HIDDEN = 4


def options(**overrides) -> ConditioningOptions:
    values = {
        "special_token_ids": frozenset({900, 901}),
        "image_token_start_id": None,
        "max_sequence_length": 512,
        "pad_to_multiple": 1,
        "dtype": torch.float32,
    }
    return ConditioningOptions(**{**values, **overrides})


def stream(
    token_ids: list[int], answer_start: int, rows: int | None = None, dtype=torch.bfloat16, prefix: int | None = 3
) -> AssembledStream:
    """Row i holds the value i in every column, so selected rows name themselves."""
    count = len(token_ids) - 1 if rows is None else rows
    values = torch.arange(count, dtype=torch.float32).unsqueeze(1).expand(count, HIDDEN).to(dtype)
    return AssembledStream(
        rows=values.contiguous(), token_ids=token_ids, answer_start_index=answer_start, prefix_tokens=prefix
    )


def handoff(cond: AssembledStream, uncond: AssembledStream | None = None) -> AssembledHandoff:
    streams: dict[StreamName, AssembledStream] = {"cond": cond} if uncond is None else {"cond": cond, "uncond": uncond}
    totals = {
        name: StreamTotals(
            rows=s.rows.shape[0],
            token_ids=token_ids_to_bytes(s.token_ids),
            answer_start_index=s.answer_start_index,
            checksum="0" * 16,
        )
        for name, s in streams.items()
    }
    close = CloseFrame(request_id="req_test", streams=totals, cached_tokens=0, cache_creation_tokens=0)
    return AssembledHandoff(open=open_frame(8, hidden=HIDDEN), close=close, streams=streams)


def selected(embeds: torch.Tensor, mask: torch.Tensor) -> list[int]:
    valid = int(mask.sum())
    assert mask[0, :valid].all() and not mask[0, valid:].any(), "valid rows come first"
    return [int(v) for v in embeds[0, :valid, 0]]


# Prompt: 3 template-prefix tokens, 5 prompt tokens (one special), then 4 generated tokens.
# The last generated token has no row: 12 tokens, 11 rows.
TOKENS = [1, 2, 3, 10, 11, 900, 12, 13, 50, 2000, 2001, 2002]
ANSWER_START = 8


def test_qwen_image_takes_the_prompt_rows_after_the_prefix():
    cond = QwenImageAdapter(options()).select(handoff(stream(TOKENS, ANSWER_START)))
    assert selected(cond.prompt_embeds, cond.prompt_embeds_mask) == [3, 4, 5, 6, 7]
    assert cond.negative_prompt_embeds is None


def test_qwen_image_selects_the_negative_stream_the_same_way():
    uncond = stream([1, 2, 3, 20, 21, 50, 60], answer_start=5)
    cond = QwenImageAdapter(options()).select(handoff(stream(TOKENS, ANSWER_START), uncond))
    assert cond.negative_prompt_embeds is not None and cond.negative_prompt_embeds_mask is not None
    assert selected(cond.negative_prompt_embeds, cond.negative_prompt_embeds_mask) == [3, 4]


def test_ar_generated_takes_text_without_specials_then_generated_rows():
    cond = ArGeneratedAdapter(options()).select(handoff(stream(TOKENS, ANSWER_START)))
    # Text rows 3, 4, 6, 7 (row 5 is token 900, a special token), then generated rows 8, 9, 10.
    assert selected(cond.prompt_embeds, cond.prompt_embeds_mask) == [3, 4, 6, 7, 8, 9, 10]


def test_ar_generated_keeps_only_image_tokens_when_told_where_they_start():
    cond = ArGeneratedAdapter(options(image_token_start_id=2000)).select(handoff(stream(TOKENS, ANSWER_START)))
    # Generated row 8 holds token 50, a text token; rows 9 and 10 are image tokens 2000, 2001.
    assert selected(cond.prompt_embeds, cond.prompt_embeds_mask) == [3, 4, 6, 7, 9, 10]


def test_rows_are_cast_after_selection_and_padded_with_a_mask():
    cond = QwenImageAdapter(options(pad_to_multiple=8)).select(handoff(stream(TOKENS, ANSWER_START)))
    assert cond.prompt_embeds.dtype == torch.float32
    assert cond.prompt_embeds.shape == (1, 8, HIDDEN)
    assert cond.prompt_embeds_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]]
    assert not cond.prompt_embeds[0, 5:].any()


def test_selection_is_a_copy_independent_of_the_row_buffer():
    source = stream(TOKENS, ANSWER_START, dtype=torch.float32)
    cond = QwenImageAdapter(options()).select(handoff(source))
    source.rows.fill_(-1)
    assert selected(cond.prompt_embeds, cond.prompt_embeds_mask) == [3, 4, 5, 6, 7]


def test_padding_never_goes_past_max_sequence_length():
    adapter = QwenImageAdapter(options(pad_to_multiple=16, max_sequence_length=6))
    cond = adapter.select(handoff(stream(TOKENS, ANSWER_START)))
    assert cond.prompt_embeds.shape[1] == 6


def test_too_many_rows_is_an_error_not_a_truncation():
    with pytest.raises(PromptTooLong, match=r"prompt too long for the DiT \(5 > 4 rows\)"):
        QwenImageAdapter(options(max_sequence_length=4)).select(handoff(stream(TOKENS, ANSWER_START)))


def test_a_prompt_that_is_all_prefix_selects_nothing_and_is_refused():
    with pytest.raises(EmptyConditioning):
        QwenImageAdapter(options()).select(handoff(stream(TOKENS, ANSWER_START, prefix=8)))


@pytest.mark.parametrize("adapter", [QwenImageAdapter, ArGeneratedAdapter])
def test_without_the_prefix_length_no_adapter_guesses_it(adapter):
    with pytest.raises(ConditioningMismatch, match="prefix_tokens"):
        adapter(options()).select(handoff(stream(TOKENS, ANSWER_START, prefix=None)))


def test_unknown_adapter_names_the_known_ones():
    with pytest.raises(ConditioningMismatch, match="ar_generated"):
        ConditioningAdapters(options()).get("telepathy")


@pytest.mark.slow
def test_padding_with_a_mask_gives_the_latents_and_image_of_trimming(tiny_model):
    runner = renderer_of(tiny_model)
    rows = torch.randn(14, tiny_model.facts.row_width, generator=torch.Generator().manual_seed(4))
    source = AssembledHandoff(
        open=open_frame(14),
        close=CloseFrame(request_id="req_test", streams={}, cached_tokens=0, cache_creation_tokens=0),
        streams={
            "cond": AssembledStream(rows=rows, token_ids=list(range(100, 115)), answer_start_index=14, prefix_tokens=2)
        },
    )
    latents, images = [], []
    for multiple in (1, 32):
        cond = QwenImageAdapter(options(pad_to_multiple=multiple)).select(source)
        assert cond.prompt_embeds.shape[1] == (12 if multiple == 1 else 32)
        latents.append(
            tiny_model.new_pipeline()(
                prompt_embeds=cond.prompt_embeds,
                prompt_embeds_mask=cond.prompt_embeds_mask,
                true_cfg_scale=1.0,
                height=32,
                width=32,
                num_inference_steps=3,
                generator=torch.Generator("cpu").manual_seed(0),
                output_type="latent",
            ).images
        )
        frames: list[ResultFrame] = []
        run(runner, RenderJob("r", cond, params(num_inference_steps=3)), frames.append)
        [image] = [f for f in frames if isinstance(f, ImageFrame)]
        images.append(np.asarray(Image.open(io.BytesIO(image.data)), dtype=int))
    # Masked attention sums in a different order than unmasked attention: equal up to float rounding,
    # which after 8-bit quantisation is at most one level on a rare pixel.
    torch.testing.assert_close(latents[0], latents[1], rtol=0, atol=1e-5)
    assert np.abs(images[0] - images[1]).max() <= 1
