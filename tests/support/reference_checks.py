"""What "equal to the reference" means for a model ardit serves, checked the same way for every family: rows and
pictures against the model's own diffusers pipeline in fp32, and in bf16 relative to that pipeline's own bf16
error (tests/e2e/test_qwen_image_reference.py, tests/e2e/test_qwen3_families.py)."""

from __future__ import annotations

import numpy as np
import torch

# What fp32 rows may differ by (the bound for Qwen-Image and each family), and how alike each row must be.
FP32_ATOL, MIN_ROW_COSINE = 5e-5, 0.99999
FP32_PIXELS = 2  # of 255
# ardit's bf16 error against the fp32 reference, as a multiple of diffusers' own bf16 error.
BF16_RATIO = 1.5


def check_rows(ardit: torch.Tensor, reference: torch.Tensor, diffusers_bf16: torch.Tensor | None = None) -> None:
    """fp32 rows equal the reference's; bf16 rows are no further from it than diffusers' own bf16 rows are."""
    assert ardit.shape == reference.shape
    ardit = ardit.float()
    if diffusers_bf16 is None:
        assert (ardit - reference).abs().max().item() <= FP32_ATOL
        assert torch.nn.functional.cosine_similarity(ardit, reference, dim=-1).min().item() >= MIN_ROW_COSINE
        return
    ours, theirs = (ardit - reference).abs(), (diffusers_bf16 - reference).abs()
    assert ours.mean().item() <= BF16_RATIO * theirs.mean().item()
    assert ours.max().item() <= BF16_RATIO * theirs.max().item()


def check_pixels(ardit: np.ndarray, reference: np.ndarray, diffusers_bf16: np.ndarray | None = None) -> None:
    """fp32 pictures within 2/255 of the reference's; bf16 no further from it than diffusers' own bf16's."""
    assert ardit.shape == reference.shape
    ours = np.abs(ardit.astype(int) - reference.astype(int))
    if diffusers_bf16 is None:
        assert ours.max() <= FP32_PIXELS
        return
    theirs = np.abs(diffusers_bf16.astype(int) - reference.astype(int))
    assert ours.mean() <= BF16_RATIO * theirs.mean()
