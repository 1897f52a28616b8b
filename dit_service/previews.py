"""Partial images: when to take them, and the clean image a flow-matching step predicts.

``callback_on_step_end`` only sees the latents *after* a step (QwenImagePipeline exposes
``latents`` and ``prompt_embeds``, not the velocity). An Euler flow-matching step is
``x_next = x_prev + (sigma_next - sigma_prev) * v``, so the velocity, and with it the predicted
clean latent ``x0 = x_prev - sigma_prev * v``, follow from the latents before and after the step.
"""

from __future__ import annotations

import torch


def preview_steps(num_inference_steps: int, partial_images: int) -> tuple[int, ...]:
    """0-based step indices after which a preview is taken: evenly spaced, all before the last step.

    A run of N steps has N - 1 steps before the last, so at most N - 1 previews come back (as with
    OpenAI's API, the final image may arrive with fewer partials than asked for).
    """
    count = min(partial_images, num_inference_steps - 1)
    return tuple((j * num_inference_steps) // (count + 1) - 1 for j in range(1, count + 1))


def clean_latent_estimate(
    before: torch.Tensor, after: torch.Tensor, sigma_before: float, sigma_after: float
) -> torch.Tensor:
    """x0 predicted at the step that took ``before`` (at sigma_before) to ``after`` (at sigma_after)."""
    before, after = before.float(), after.float()
    velocity = (after - before) / (sigma_after - sigma_before)
    return before - sigma_before * velocity
