"""Packed transformer latents → a PIL image, through the shared VAE.

The pipeline runs with ``output_type="latent"`` so the service decodes itself: that times the VAE
separately, skips the decode of an interrupted run, and decodes previews the same way as finals.
"""

from __future__ import annotations

import PIL.Image
import torch
from diffusers import QwenImagePipeline
from diffusers.image_processor import VaeImageProcessor

from dit_service.model import DitModel


class LatentDecoder:
    def __init__(self, model: DitModel) -> None:
        self._model = model
        vae = model.vae
        z_dim = vae.config.z_dim
        # Same arithmetic as QwenImagePipeline's own decode, so the output is bitwise the pipeline's.
        shape = (1, z_dim, 1, 1, 1)
        self._mean = torch.tensor(vae.config.latents_mean).view(shape).to(vae.device, vae.dtype)
        self._inverse_std = (1.0 / torch.tensor(vae.config.latents_std)).view(shape).to(vae.device, vae.dtype)
        self._processor = VaeImageProcessor(vae_scale_factor=model.vae_scale_factor * 2)

    @torch.no_grad()
    def decode(self, packed: torch.Tensor, height: int, width: int) -> PIL.Image.Image:
        """``packed``: [1, patches, channels] as the transformer produces them."""
        vae = self._model.vae
        latents = QwenImagePipeline._unpack_latents(packed, height, width, self._model.vae_scale_factor)
        latents = latents.to(device=vae.device, dtype=vae.dtype) / self._inverse_std + self._mean
        with self._model.vae_lock:
            pixels = vae.decode(latents, return_dict=False)[0][:, :, 0]
        return self._processor.postprocess(pixels, output_type="pil")[0]
