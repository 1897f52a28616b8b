from __future__ import annotations

import pytest
import torch

# From its own module: to a type checker diffusers' top-level names are its no-torch placeholder classes.
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

from dit_service.previews import clean_latent_estimate, preview_steps


@pytest.mark.parametrize(
    "steps, partials, expected",
    [(10, 0, ()), (10, 1, (4,)), (10, 3, (1, 4, 6)), (4, 3, (0, 1, 2)), (4, 9, (0, 1, 2)), (2, 1, (0,)), (1, 2, ())],
)
def test_previews_are_evenly_spaced_and_all_before_the_last_step(steps, partials, expected):
    chosen = preview_steps(steps, partials)
    assert chosen == expected
    assert len(set(chosen)) == len(chosen) and all(0 <= s < steps - 1 for s in chosen)


def test_clean_latent_is_recovered_from_an_euler_step():
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
    scheduler.set_timesteps(5)
    generator = torch.Generator().manual_seed(0)
    clean, noise = torch.randn(2, 8, generator=generator), torch.randn(2, 8, generator=generator)
    sigma, sigma_next = float(scheduler.sigmas[1]), float(scheduler.sigmas[2])
    before = sigma * noise + (1 - sigma) * clean
    velocity = noise - clean  # flow matching's target
    scheduler._step_index = 1
    after = scheduler.step(velocity, scheduler.timesteps[1], before, return_dict=False)[0]
    estimate = clean_latent_estimate(before, after, sigma, sigma_next)
    torch.testing.assert_close(estimate, clean, rtol=0, atol=1e-5)
