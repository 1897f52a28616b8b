"""What the renderer is given and what it gives back: the job types of the DiT's render path.

A ``RenderJob`` is one complete handoff as the pipeline takes it (conditioning, diffusion
parameters, an edit's image); a ``RenderItem`` is a job on its way through the renderer with where
its result frames go (``emit``) and how its consumer says it left (``cancel``). The renderer returns
each item's ``RenderTimings``, or ``RenderCancelled`` for one whose consumer left.

An edit's strength is diffusers' img2img strength: of a ``num_inference_steps`` schedule, the last
``denoising_steps`` (ceil(steps * strength)) run, starting from the input noised to where they
begin; strength 0 runs none (the answer is the input through the VAE and back). With a mask, only
its nonzero pixels are repainted; every other pixel of the answer is the input's own. A reference edit
has no strength: its whole schedule runs from noise, its pipeline reading the pictures beside the rows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import PIL.Image

from dit_service.conditioning import Conditioning
from dit_service.handoff_trace import HandoffTrace
from shared.diffusion import DiffusionParams, edit_steps
from shared.handoff_assembler import AssembledEdit
from shared.result_frames import ImageFrame, PartialImageFrame, ProgressFrame

RenderFrame = PartialImageFrame | ImageFrame | ProgressFrame
EmitResult = Callable[[RenderFrame], None]
# The diffusion parameters each image of a batch may have its own of; the batch shares every other one.
_PER_IMAGE = frozenset({"seed", "output_format", "output_compression"})
BatchKey = tuple[tuple[str, object], ...]


@dataclass(frozen=True)
class EditInput:
    pictures: tuple[PIL.Image.Image, ...]  # RGB, each at its own size (an img2img edit's one at the output size)
    mask: PIL.Image.Image | None  # L, at the first picture's size: 255 = repaint, 0 = keep
    strength: float | None  # None: a reference edit

    @classmethod
    def of(cls, edit: AssembledEdit) -> EditInput:
        mask = None
        if edit.mask is not None:
            # Any nonzero value repaints (diffusers binarises at one half; the AR sends 0 or 255).
            mask = PIL.Image.fromarray(edit.mask[:, :, 0].numpy()).point(lambda v: 255 if v else 0)
        pictures = tuple(PIL.Image.fromarray(picture.numpy()) for picture in edit.pictures)
        return cls(pictures, mask, edit.strength)

    def denoising_steps(self, num_inference_steps: int) -> int:
        """Steps that run: diffusers' ``get_timesteps`` arithmetic, so the count is what its loop does (all of them
        for a reference edit)."""
        return edit_steps(num_inference_steps, self.strength)


@dataclass(frozen=True)
class RenderJob:
    request_id: str
    conditioning: Conditioning
    params: DiffusionParams
    edit: EditInput | None = None
    trace: HandoffTrace = field(default_factory=HandoffTrace)

    @property
    def denoising_steps(self) -> int:
        """Steps each image runs (an edit runs the last part of its schedule)."""
        steps = self.params.num_inference_steps
        return steps if self.edit is None else self.edit.denoising_steps(steps)

    @property
    def batch_key(self) -> BatchKey | None:
        """What a batch must share — every diffusion parameter the denoising loop reads (size, steps,
        guidance, previews, and any added later) — or None for a job rendered on its own (an edit, n > 1)."""
        p = self.params
        if self.edit is not None or p.num_images != 1:
            return None
        return tuple((name, value) for name, value in p if name not in _PER_IMAGE)


@dataclass(frozen=True)
class RenderItem:
    job: RenderJob
    emit: EmitResult
    cancel: threading.Event


@dataclass
class RenderTimings:
    """Seconds summed over a job's images. Preview work happens inside denoising but is kept apart."""

    vae_encode: float = 0.0  # an edit's image, once per job
    denoise: float = 0.0
    vae_decode: float = 0.0
    encode: float = 0.0
    previews: float = 0.0


class RenderCancelled(Exception):
    """The consumer went away; the run stopped at the next denoising step."""


RenderOutcome = RenderTimings | RenderCancelled
