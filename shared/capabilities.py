"""What a DiT announces about itself, in the body of its ``/readyz`` when ready.

The DiT owns every fact about what it can render (sizes, steps, guidance, images per request,
conditioning length), its defaults and its capacity. The AR reads the announcement when the DiT
becomes ready (at start and after every reconnect) and checks public requests against it before
any engine work, so no limit is configured twice. The DiT still enforces every limit on ``open``:
the announcement lets the AR refuse early, it is not what makes the DiT safe.

JSON, not msgpack: it is small, read every few seconds at most, and operators read it with curl.
Receivers ignore keys they do not know, like the handoff frames.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from shared.frames import OutputFormat

PosInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")


class DiffusionLimits(_Model):
    # Pixel sizes must be multiples of this (VAE factor x patch size), or diffusers rounds them down.
    size_multiple: PosInt
    max_pixels: PosInt
    min_inference_steps: PosInt
    max_inference_steps: PosInt
    max_guidance_scale: Annotated[float, Field(ge=0.0)]
    max_images: PosInt
    # Most rows that may condition one image (the prompt's rows after the template prefix).
    max_conditioning_rows: PosInt
    output_formats: list[OutputFormat]


class DiffusionDefaults(_Model):
    """What the model renders best when a request does not say."""

    width: PosInt
    height: PosInt
    num_inference_steps: PosInt
    guidance_scale: Annotated[float, Field(ge=0.0)]


class DitCapacity(_Model):
    """How much work one DiT replica holds at once; the AR admits requests against it."""

    max_concurrent_handoffs: PosInt
    max_pipeline_runs: PosInt
    pipeline_queue_size: NonNegInt

    @property
    def max_admitted(self) -> int:
        """Renders that may be running or waiting for a run at once."""
        return self.max_pipeline_runs + self.pipeline_queue_size

    @property
    def max_outstanding(self) -> int:
        """Requests one sender may have at this DiT at once without being refused: each holds a
        handoff slot while its rows arrive and a run ticket from completion to its last image."""
        return min(self.max_admitted, self.max_concurrent_handoffs)


class DitCapabilities(_Model):
    model: Annotated[str, Field(min_length=1, max_length=256)]
    description: str
    # The width of the rows this DiT is conditioned on (its joint_attention_dim).
    hidden_size: PosInt
    conditioning: list[str]
    limits: DiffusionLimits
    defaults: DiffusionDefaults
    capacity: DitCapacity
