"""deploy/checkpoints/qwen_vae_2d.py: the single-frame 2-D view computes what AutoencoderKLQwenImage computes."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage

from deploy.checkpoints import qwen_vae_2d

CONFIGS = [
    # the demo model's VAE
    {
        "base_dim": 16,
        "z_dim": 8,
        "dim_mult": [1, 1, 1, 1],
        "num_res_blocks": 0,
        "temperal_downsample": [False, True, True],
    },
    # residual blocks in every stage and widening channels (shortcut convolutions). Not attention in the
    # stages: diffusers' own encoder cannot run that (it passes the feature cache to the attention block).
    {"base_dim": 8, "z_dim": 4, "dim_mult": [1, 2, 2], "num_res_blocks": 1, "temperal_downsample": [False, True]},
]


@pytest.mark.parametrize("config", CONFIGS)
def test_encode_and_decode_match_the_stock_video_path(config):
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(**config).eval()
    for module in vae.modules():  # non-trivial time taps: the 2-D view must ignore all but the last
        if isinstance(module, torch.nn.Conv3d):
            torch.nn.init.normal_(module.weight, std=0.2)
    pixels = torch.rand(2, 3, 32, 32) * 2 - 1
    latents = torch.randn(2, config["z_dim"], 32 // vae.spatial_compression_ratio, 32 // vae.spatial_compression_ratio)
    with torch.no_grad():
        posterior = vae.encode(pixels[:, :, None]).latent_dist
        mean, logvar = qwen_vae_2d.encode(vae, pixels)
        stock = vae.decode(latents[:, :, None]).sample[:, :, 0]
        decoded = qwen_vae_2d.decode(vae, latents).clamp(-1, 1)
    torch.testing.assert_close(mean, posterior.mean[:, :, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logvar, posterior.logvar[:, :, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decoded, stock, atol=1e-5, rtol=1e-5)
    assert stock.std() > 0.05  # the comparison saw real signal, not two saturated pictures


def test_gradients_reach_only_the_last_time_tap():
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(**CONFIGS[0])
    mean, _ = qwen_vae_2d.encode(vae, torch.rand(1, 3, 32, 32))
    qwen_vae_2d.decode(vae, mean).square().mean().backward()
    grad = vae.decoder.conv_in.weight.grad
    assert grad[:, :, -1].abs().sum() > 0 and grad[:, :, :-1].abs().sum() == 0
