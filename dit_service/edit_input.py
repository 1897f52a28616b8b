"""An image edit as the runner takes it: the image, its mask, the strength, and what they imply.

Strength is diffusers' img2img strength: of a ``num_inference_steps`` schedule, the last
``denoising_steps`` (ceil(steps * strength)) run, starting from the input noised to where they begin.
Strength 0 runs none: the answer is the input through the VAE and back.
With a mask, only its nonzero pixels are repainted; every other pixel of the answer is the
input's own (diffusers' ``apply_overlay``), whatever the VAE does to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import PIL.Image

from shared.handoff_assembler import AssembledEdit


@dataclass(frozen=True)
class EditInput:
    image: PIL.Image.Image  # RGB, at the output size
    mask: PIL.Image.Image | None  # L, at the output size: 255 = repaint, 0 = keep
    strength: float

    @classmethod
    def of(cls, edit: AssembledEdit) -> EditInput:
        mask = None
        if edit.mask is not None:
            # Any nonzero value repaints (diffusers binarises at one half; the AR sends 0 or 255).
            mask = PIL.Image.fromarray(edit.mask[:, :, 0].numpy()).point(lambda v: 255 if v else 0)
        return cls(PIL.Image.fromarray(edit.image.numpy()), mask, edit.strength)

    def denoising_steps(self, num_inference_steps: int) -> int:
        """Steps that run: diffusers' ``get_timesteps`` arithmetic, so the count is what its loop does."""
        skipped = int(max(num_inference_steps - min(num_inference_steps * self.strength, num_inference_steps), 0))
        return num_inference_steps - skipped
