"""Streamed hidden rows equal a transformers forward over the same tokens (the captured layer's states, put
through the final norm), and the generated tokens equal greedy transformers: in fp32. In bf16 (the default
on a CPU that multiplies it natively), the rows are as close to transformers' fp32 as transformers' own bf16
rows are. Real vLLM (CPU), at the AR's default layer."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.ar_service.engine.engine_runs import run_engine

pytestmark = pytest.mark.slow

PROMPTS = ["a red fox in fresh snow", "a lighthouse at dusk, oil painting, dramatic sky", "cat"]


@pytest.fixture(scope="module")
def hf_model(stack):
    model = AutoModelForCausalLM.from_pretrained(str(stack.settings.model_dir), dtype=torch.float32)
    return model.eval()


def hf_rows(hf_model, token_ids: list[int], layer: int):
    """transformers' rows of ``layer`` through the final norm (transformers applies it to the last entry only),
    and its logits."""
    with torch.no_grad():
        out = hf_model(torch.tensor([token_ids]), output_hidden_states=True)
        normed = (
            out.hidden_states[layer]
            if layer == len(out.hidden_states) - 1
            else hf_model.model.norm(out.hidden_states[layer])
        )
    return normed[0], out.logits[0]


@pytest.mark.parametrize("text", PROMPTS)
def test_rows_match_transformers_and_tokens_match_greedy(stack, fp32_engine, hf_model, text):
    prompt = stack.runtime.prompts.build(text).token_ids
    run = fp32_engine.call(run_engine(fp32_engine.engine, prompt, max_new_tokens=6))

    sequence = run.finished.token_ids
    assert len(sequence) == len(prompt) + 6
    # The last sampled token is never an input: one row per token but the last.
    assert run.finished.row_count == len(sequence) - 1 == run.rows.shape[0]
    assert run.row_token_ids == sequence[:-1]

    expected, logits = hf_rows(hf_model, sequence[:-1], fp32_engine.engine.rows.layers[0])
    assert run.rows.dtype == torch.float32
    # vLLM's CPU kernels and transformers' differ in summation order over the layers: elements
    # agree to 1e-4, or to 1e-5 relative where the value is large (max seen: 1.4e-4 on a value
    # of 15.2). 99.9% of elements must be within 1e-4 absolute.
    torch.testing.assert_close(run.rows, expected, atol=1e-4, rtol=1e-5)
    assert (run.rows - expected).abs().flatten().quantile(0.999).item() <= 1e-4
    greedy = logits[len(prompt) - 1 :].argmax(-1).tolist()
    assert run.finished.generated_token_ids == greedy


@pytest.mark.parametrize("text", PROMPTS)
def test_bf16_rows_are_as_close_to_transformers_as_its_own_bf16_rows(stack, hf_model, text):
    engine = stack.runtime.engine
    if engine.dtype != torch.bfloat16:
        pytest.skip("this CPU does not multiply bf16 natively: the AR runs fp32 (the test above)")
    prompt = stack.runtime.prompts.build(text).token_ids
    run = stack.ar.call(run_engine(engine, prompt, max_new_tokens=1))
    assert run.rows.dtype == torch.bfloat16
    reference, _ = hf_rows(hf_model, prompt, engine.rows.layers[0])
    own_bf16, _ = hf_rows(copy.deepcopy(hf_model).to(torch.bfloat16), prompt, engine.rows.layers[0])
    ours, theirs = (run.rows.float() - reference).abs(), (own_bf16.float() - reference).abs()
    assert ours.mean().item() <= 1.5 * theirs.mean().item()


def test_rows_stream_prompt_first_then_one_per_decode_step(stack):
    runtime = stack.runtime
    prompt = runtime.prompts.build("streaming order").token_ids
    run = stack.ar.call(run_engine(runtime.engine, prompt, max_new_tokens=5))
    starts = [start for start, _ in run.chunks]
    assert starts == sorted(starts) and run.chunks[0] == (0, len(prompt))
    assert sum(count for _, count in run.chunks) == len(prompt) + 5 - 1
