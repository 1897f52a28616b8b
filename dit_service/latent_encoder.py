"""An edit's image → the normalised VAE latents Qwen-Image's edit pipelines start from.

The service encodes itself, under the shared VAE's lock (a pipeline's own encode would run
unlocked while another run decodes), and takes the mode of the latent distribution: the latent
closest to the input and no random draw, so strength 0 returns the input up to the VAE round
trip. The edit pipelines take these latents in place of an image: their image processor passes
a tensor with the VAE's latent channel count through untouched.
"""

from __future__ import annotations

import PIL.Image
import torch
from diffusers.image_processor import VaeImageProcessor

from dit_service.model import DitModel


class LatentEncoder:
    def __init__(self, model: DitModel) -> None:
        self._model = model
        vae = model.vae
        # Same arithmetic as the edit pipelines' ``_encode_vae_image``.
        shape = (1, vae.config.z_dim, 1, 1, 1)
        self._mean = torch.tensor(vae.config.latents_mean).view(shape).to(vae.device, vae.dtype)
        self._inverse_std = (1.0 / torch.tensor(vae.config.latents_std)).view(shape).to(vae.device, vae.dtype)
        # The pipelines' own preprocessing: RGB in [-1, 1], [1, 3, height, width].
        self._processor = VaeImageProcessor(vae_scale_factor=model.vae_scale_factor * 2)

    def pixels(self, image: PIL.Image.Image) -> torch.Tensor:
        """``image`` as the pipelines see it: [1, 3, height, width] in [-1, 1]."""
        return self._processor.preprocess(image, height=image.height, width=image.width).to(torch.float32)

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """[1, 3, height, width] in [-1, 1] → normalised latents [1, z_dim, height / 8, width / 8]."""
        vae = self._model.vae
        frames = pixels.to(device=vae.device, dtype=vae.dtype).unsqueeze(2)  # the VAE takes [B, C, T, H, W]
        with self._model.vae_lock:
            latents = vae.encode(frames).latent_dist.mode()
        return ((latents - self._mean) * self._inverse_std)[:, :, 0]
