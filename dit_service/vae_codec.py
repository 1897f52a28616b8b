"""Pixels ↔ the transformer's packed latents, through the shared VAE: every private diffusers call
the DiT makes is fenced in here.

The pipeline runs with ``output_type="latent"`` so the service decodes itself: that times the VAE
separately, skips the decode of an interrupted run, and decodes previews the same way as finals.
An edit's image is encoded here too, under the shared VAE's lock (a pipeline's own encode would
run unlocked while another run decodes), taking the mode of the latent distribution: the latent
closest to the input and no random draw, so strength 0 returns the input up to the VAE round trip.
The edit pipelines take these latents in place of an image (their image processor passes a tensor
with the VAE's latent channel count through untouched). The arithmetic is the pipelines' own
(``_encode_vae_image``, the decode at the end of ``__call__``), so results are bitwise theirs.
"""

from __future__ import annotations

import PIL.Image
import torch
from diffusers import QwenImagePipeline
from diffusers.image_processor import VaeImageProcessor

from dit_service.shared_vae import SharedVae


class VaeCodec:
    def __init__(self, shared: SharedVae) -> None:
        self._shared = shared
        vae = shared.module
        shape = (1, vae.config.z_dim, 1, 1, 1)
        self._mean = torch.tensor(vae.config.latents_mean).view(shape).to(vae.device, vae.dtype)
        self._inverse_std = (1.0 / torch.tensor(vae.config.latents_std)).view(shape).to(vae.device, vae.dtype)
        # The pipelines' own pre- and postprocessing: RGB in [-1, 1], [1, 3, height, width].
        self._processor = VaeImageProcessor(vae_scale_factor=shared.scale_factor * 2)

    def pixels(self, image: PIL.Image.Image) -> torch.Tensor:
        """``image`` as the pipelines see it: [1, 3, height, width] in [-1, 1]."""
        pixels: torch.Tensor = self._processor.preprocess(image, height=image.height, width=image.width)
        return pixels.to(torch.float32)

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """[1, 3, height, width] in [-1, 1] → normalised latents [1, z_dim, height / 8, width / 8]."""
        vae = self._shared.module
        frames = pixels.to(device=vae.device, dtype=vae.dtype).unsqueeze(2)  # the VAE takes [B, C, T, H, W]
        with self._shared.lock:
            latents = vae.encode(frames).latent_dist.mode()
        normalised: torch.Tensor = ((latents - self._mean) * self._inverse_std)[:, :, 0]
        return normalised

    @staticmethod
    def packed(latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents [1, z_dim, h, w] → [1, patches, channels], as the transformer produces them."""
        packed: torch.Tensor = QwenImagePipeline._pack_latents(latents, 1, *latents.shape[1:])
        return packed

    @torch.no_grad()
    def decode(self, packed: torch.Tensor, height: int, width: int) -> PIL.Image.Image:
        """``packed``: [1, patches, channels] as the transformer produces them."""
        vae = self._shared.module
        latents = QwenImagePipeline._unpack_latents(packed, height, width, self._shared.scale_factor)
        latents = latents.to(device=vae.device, dtype=vae.dtype) / self._inverse_std + self._mean
        with self._shared.lock:
            pixels = vae.decode(latents, return_dict=False)[0][:, :, 0]
        image: PIL.Image.Image = self._processor.postprocess(pixels, output_type="pil")[0]
        return image

    def pasted_back(self, image: PIL.Image.Image, mask: PIL.Image.Image, original: PIL.Image.Image) -> PIL.Image.Image:
        """``image`` where ``mask`` is nonzero, ``original``'s own pixels everywhere else (the inpaint
        pipeline's ``apply_overlay``: not the original's VAE round trip)."""
        pasted: PIL.Image.Image = self._processor.apply_overlay(mask, original, image)
        return pasted
