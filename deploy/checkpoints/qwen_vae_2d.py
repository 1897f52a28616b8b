"""``AutoencoderKLQwenImage`` on single pictures, run with 2-D convolutions over its own parameters.

The Qwen-Image VAE is a video VAE: its convolutions are causal in time, padded with two zero frames in
front. For a single frame only the kernel's last time tap ever meets data, so each 3x3x3 convolution is
a 3x3 convolution with that tap's weights, and the temporal resamplers do nothing on a first frame
(diffusers skips their time convolutions there). Training through this view is about twice as fast as
through ``vae.encode``/``vae.decode``, and the gradients land on the same parameters, so the trained
model is the stock class. ``tests/deploy/test_qwen_vae_2d.py`` checks both paths give the same numbers.

Only the layers a single frame uses are covered (residual blocks, attention blocks, resamplers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# From its own module: to a type checker diffusers' top-level AutoencoderKLQwenImage is a no-torch placeholder.
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import (
    AutoencoderKLQwenImage,
    QwenImageAttentionBlock,
    QwenImageCausalConv3d,
    QwenImageMidBlock,
    QwenImageResample,
    QwenImageResidualBlock,
    QwenImageRMS_norm,
    QwenImageUpBlock,
)


def conv(layer: QwenImageCausalConv3d, x: torch.Tensor) -> torch.Tensor:
    # _padding is (w, w, h, h, time-front, time-back); only the last time tap sees the frame.
    height, width = int(layer._padding[2]), int(layer._padding[0])
    return F.conv2d(x, layer.weight[:, :, -1], layer.bias, padding=(height, width))


def rms_norm(norm: QwenImageRMS_norm, x: torch.Tensor) -> torch.Tensor:
    gamma = norm.gamma.view(-1, 1, 1)
    bias = norm.bias.view(-1, 1, 1) if isinstance(norm.bias, torch.Tensor) else norm.bias
    return F.normalize(x, dim=1) * norm.scale * gamma + bias


def residual(block: QwenImageResidualBlock, x: torch.Tensor) -> torch.Tensor:
    shortcut = x if isinstance(block.conv_shortcut, torch.nn.Identity) else conv(block.conv_shortcut, x)
    x = conv(block.conv1, block.nonlinearity(rms_norm(block.norm1, x)))
    x = conv(block.conv2, block.dropout(block.nonlinearity(rms_norm(block.norm2, x))))
    return x + shortcut


def attention(block: QwenImageAttentionBlock, x: torch.Tensor) -> torch.Tensor:
    return block(x.unsqueeze(2)).squeeze(2)  # the block already works frame by frame


def layer_2d(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(layer, QwenImageResidualBlock):
        return residual(layer, x)
    if isinstance(layer, QwenImageAttentionBlock):
        return attention(layer, x)
    if isinstance(layer, QwenImageResample):
        return layer.resample(x)
    if isinstance(layer, QwenImageMidBlock):
        x = layer_2d(layer.resnets[0], x)
        for attn, resnet in zip(layer.attentions, layer.resnets[1:], strict=True):
            x = layer_2d(resnet, layer_2d(attn, x))
        return x
    raise TypeError(f"no single-frame path for {type(layer).__name__}")


def encode(vae: AutoencoderKLQwenImage, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 3, H, W] in [-1, 1] → posterior mean and log-variance, each [B, z_dim, H/8, W/8]."""
    encoder = vae.encoder
    x = conv(encoder.conv_in, pixels)
    for layer in encoder.down_blocks:
        x = layer_2d(layer, x)
    x = layer_2d(encoder.mid_block, x)
    x = conv(encoder.conv_out, encoder.nonlinearity(rms_norm(encoder.norm_out, x)))
    mean, logvar = conv(vae.quant_conv, x).chunk(2, dim=1)
    return mean, logvar.clamp(-30.0, 20.0)  # as diffusers' DiagonalGaussianDistribution


def decode(vae: AutoencoderKLQwenImage, latents: torch.Tensor) -> torch.Tensor:
    """[B, z_dim, h, w] → [B, 3, 8h, 8w], not clamped (``vae.decode`` clamps to [-1, 1])."""
    decoder = vae.decoder
    x = conv(decoder.conv_in, conv(vae.post_quant_conv, latents))
    x = layer_2d(decoder.mid_block, x)
    for block in decoder.up_blocks:
        assert isinstance(block, QwenImageUpBlock)
        for resnet in block.resnets:
            x = layer_2d(resnet, x)
        if block.upsamplers is not None:
            x = layer_2d(block.upsamplers[0], x)
    return conv(decoder.conv_out, decoder.nonlinearity(rms_norm(decoder.norm_out, x)))
