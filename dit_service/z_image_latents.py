"""Z-Image's latents → a picture, for previews: ZImagePipeline's own decode at the end of ``__call__``.

Z-Image's pipeline decodes its finished images itself (its model card); a preview is a latent the step
callback estimated mid-run, which the service decodes here with the same arithmetic (``latents / scaling_factor +
shift_factor``, the VAE, the pipeline's image processor) on the shared VAE. Its ``AutoencoderKL`` keeps no state on
the module between calls, so previews and a pipeline's own decode may run at once.
"""

from __future__ import annotations

import PIL.Image
import torch
from diffusers.image_processor import VaeImageProcessor

from dit_service.shared_vae import SharedVae


class ZImageLatents:
    def __init__(self, shared: SharedVae) -> None:
        self._vae = shared.module
        self._processor = VaeImageProcessor(vae_scale_factor=shared.scale_factor * 2)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> PIL.Image.Image:
        """``latents``: [1, channels, height / 8, width / 8], as Z-Image's transformer denoises them."""
        vae = self._vae
        latents = latents.to(device=vae.device, dtype=vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        pixels = vae.decode(latents, return_dict=False)[0]
        image: PIL.Image.Image = self._processor.postprocess(pixels, output_type="pil")[0]
        return image
