"""deploy/checkpoints/demo_rows.py: the rows the demo DiT trains on are the rows the running AR streams (at its
default layer) and the DiT keeps (template prefix dropped), within the tolerance established against
transformers."""

from __future__ import annotations

import pytest
import torch

from deploy.checkpoints.demo_rows import PromptRows
from shared.row_recipe import QWEN_IMAGE_TEMPLATE
from tests.ar_service.engine.engine_runs import run_engine

pytestmark = pytest.mark.slow

PROMPTS = [
    "a red circle on a blue background, in the top left",
    "blue background, yellow triangular shape in the lower-right corner",
    "there is a white box at the lower left; the background is black",
    " ",  # the AR's default negative prompt: it merges into the template prefix's last token
]


@pytest.fixture(scope="module")
def prompt_rows(stack) -> PromptRows:
    return PromptRows(stack.settings.model_dir, QWEN_IMAGE_TEMPLATE, *stack.runtime.engine.rows.layers)


def test_rows_after_the_template_prefix_equal_what_the_engine_streams(stack, fp32_engine, prompt_rows):
    # The trainer's rows are fp32 (demo_rows.py), so the engine's are compared in fp32.
    computed = prompt_rows.rows(PROMPTS, batch_size=2)
    for text, rows in zip(PROMPTS, computed, strict=True):
        built = stack.runtime.prompts.build(text)
        run = fp32_engine.call(run_engine(fp32_engine.engine, built.token_ids, max_new_tokens=1))
        streamed = run.rows[built.prefix_tokens : len(built.token_ids)]
        assert rows.shape == streamed.shape == (len(built.token_ids) - built.prefix_tokens, 576)
        # The tolerance of tests/ar_service/test_engine_golden.py (vLLM's CPU kernels vs transformers).
        torch.testing.assert_close(rows, streamed, atol=1e-4, rtol=1e-5)
        assert (rows - streamed).abs().flatten().quantile(0.999).item() <= 1e-4


def test_rows_do_not_depend_on_the_other_prompts_of_a_batch(prompt_rows):
    alone = prompt_rows.rows(PROMPTS[:1])[0]
    batched = prompt_rows.rows(PROMPTS, batch_size=len(PROMPTS))[0]
    torch.testing.assert_close(alone, batched, atol=1e-5, rtol=1e-5)
