"""What the DiT is asked to render (``DiffusionParams``), and every fact about it that the public
API, the AR and the DiT share, each defined once here.

The public request models (``ar_service/api/protocol.py``) and the DiT's settings derive their
bounds and patterns from these; the limits a DiT announces (``shared/capabilities.py``) are checked
against ``DiffusionParams`` by one function on both sides.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Annotated, Literal, TypeVar, get_args

from pydantic import AfterValidator, Field, model_validator

from shared.frame_types import PosInt, WireModel

# Seeds are signed 64-bit: what JSON clients (OpenAPI ``int64``), msgpack and ``torch.Generator``
# all hold. Image i of a request renders with seed + i, so seed + n - 1 must fit too.
MAX_SEED = 2**63 - 1
# Previews a request may ask for (OpenAI's ``partial_images`` bound).
MAX_PARTIAL_IMAGES = 3
# Images one request may ask for (OpenAI's ``n`` bound); a DiT may announce fewer.
MAX_IMAGES = 10
# The encoded image files a DiT may produce, with their media types.
OutputFormat = Literal["png", "jpeg", "webp"]
MEDIA_TYPES: dict[OutputFormat, str] = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
# ``WIDTHxHEIGHT`` in ASCII digits, at most 5 a side: no int() of a 4,300-digit or non-ASCII "digit" string.
SIZE = r"[0-9]{1,5}x[0-9]{1,5}"
SIZE_PATTERN = f"^{SIZE}$"
_SIZE = re.compile(SIZE_PATTERN)
# One size as the API names it: "1024x1024".
Size = Annotated[str, Field(pattern=SIZE_PATTERN)]


# TaylorSeer's full passes come at least this often.
MAX_STEP_CACHE_INTERVAL = 10
# A custom noise schedule holds one sigma per step, at most this many (whatever a DiT's step limit).
MAX_SIGMAS = 1000
Number = TypeVar("Number", bound=float)


def _schedule(sigmas: list[Number]) -> list[Number]:
    """diffusers' ``sigmas``: strictly decreasing noise levels in (0, 1], one per step."""
    if not all(math.isfinite(s) and 0 < s <= 1 for s in sigmas):
        raise ValueError("every sigma is a noise level in (0, 1]")
    if any(later >= earlier for earlier, later in itertools.pairwise(sigmas)):
        raise ValueError("sigmas decrease strictly, from the noisiest step to the cleanest")
    return sigmas


# The one shape of a noise schedule; the public API parameterises it with its JSON number type.
Sigmas = Annotated[list[Number], Field(min_length=1, max_length=MAX_SIGMAS), AfterValidator(_schedule)]


# The bounds of each step cache's knob, as the public API and the wire both check them.
FIRST_BLOCK_THRESHOLD = Field(gt=0.0, le=1.0)
TAYLORSEER_INTERVAL = Field(ge=2, le=MAX_STEP_CACHE_INTERVAL)


class FirstBlockCache(WireModel):
    """diffusers' First Block Cache (``FirstBlockCacheConfig``): when the first block's residual changed
    by less than ``threshold`` (relative mean absolute change) since the last full pass, the other
    blocks are skipped and their cached residual reused. Higher is faster and further from uncached."""

    method: Literal["first_block"]
    threshold: Annotated[float, FIRST_BLOCK_THRESHOLD]


class TaylorSeerCache(WireModel):
    """diffusers' TaylorSeer (``TaylorSeerCacheConfig``): a full pass every ``interval`` steps (after the
    first three); between them each attention's output is extrapolated by a first-order Taylor series."""

    method: Literal["taylorseer"]
    interval: Annotated[int, TAYLORSEER_INTERVAL]


# A step cache skips transformer work between denoising steps, through diffusers' own hooks only.
# Absent (None): every step runs the whole transformer.
StepCache = Annotated[FirstBlockCache | TaylorSeerCache, Field(discriminator="method")]
StepCacheMethod = Literal["first_block", "taylorseer"]
STEP_CACHE_METHODS: tuple[StepCacheMethod, ...] = get_args(StepCacheMethod)


def edit_steps(num_inference_steps: int, strength: float | None) -> int:
    """The steps an edit runs of a ``num_inference_steps`` schedule: diffusers' img2img ``get_timesteps`` arithmetic
    (the last ``steps * strength``, rounded as it rounds), so the count is what its loop does; all of them for a
    reference edit (no strength)."""
    if strength is None:
        return num_inference_steps
    skipped = int(max(num_inference_steps - min(num_inference_steps * strength, num_inference_steps), 0))
    return num_inference_steps - skipped


class ReferencePictureRules(WireModel):
    """How a family's pipeline takes reference pictures it reads itself, beside rows of a text-only encoder
    (``Flux2KleinPipeline``'s ``__call__``): each at least ``min_side`` on both sides and at most ``max_aspect``
    times longer than wide (its ``check_image_input``), scaled into ``max_area`` where larger (Lanczos, sides
    truncated), then cropped to multiples of ``multiple``; without a size asked it draws at the first picture's."""

    max_pictures: PosInt
    min_side: PosInt
    max_aspect: PosInt
    max_area: PosInt
    multiple: PosInt

    def refusal(self, width: int, height: int) -> str | None:
        """Why the pipeline refuses a ``width`` x ``height`` picture; None: it takes it."""
        if min(width, height) < self.min_side:
            return f"is {width}x{height}: each side must be at least {self.min_side} pixels"
        if max(width, height) > self.max_aspect * min(width, height):
            return f"is {width}x{height}: its aspect may be at most {self.max_aspect}:1"
        return None

    def within_area(self, width: int, height: int) -> tuple[int, int]:
        """The size the pipeline scales a picture to before it crops it (its own, where within ``max_area``)."""
        if width * height <= self.max_area:
            return width, height
        scale = math.sqrt(self.max_area / (width * height))
        return int(width * scale), int(height * scale)

    def drawn_size(self, width: int, height: int) -> tuple[int, int]:
        """The size the pipeline draws at from a first picture of ``width`` x ``height`` when no size is asked."""
        scaled_width, scaled_height = self.within_area(width, height)
        return scaled_width // self.multiple * self.multiple, scaled_height // self.multiple * self.multiple


def parse_size(size: str) -> tuple[int, int]:
    """``"WIDTHxHEIGHT"`` → (width, height); ``ValueError`` for anything else."""
    if not _SIZE.match(size):
        raise ValueError(f"size {size!r} is not WIDTHxHEIGHT")
    width, _, height = size.partition("x")
    return int(width), int(height)


class DiffusionParams(WireModel):
    """What the DiT is asked to render. Ranges the model cannot do are the DiT's to reject
    (``DiffusionLimits.check``)."""

    width: PosInt
    height: PosInt
    num_inference_steps: PosInt
    guidance_scale: float = Field(ge=0.0)
    # Image i of the request renders with seed + i.
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)]
    num_images: PosInt = 1
    output_format: OutputFormat = "png"
    output_compression: Annotated[int, Field(ge=0, le=100)] | None = None
    partial_images: Annotated[int, Field(ge=0, le=MAX_PARTIAL_IMAGES)] = 0
    # A custom noise schedule (diffusers' ``sigmas``, before the scheduler's shift), one per step.
    # Absent: the pipeline's own (a linear ramp from 1 to 1/steps).
    sigmas: Sigmas[float] | None = None
    # Skip transformer work between steps (diffusers' cache hooks); only a method the DiT announced.
    step_cache: StepCache | None = None
    # Classifier-free guidance runs at a guidance scale above this: the DiT's family's, as it announces it
    # (Qwen-Image's ``true_cfg_scale`` above 1, Z-Image's ``guidance_scale`` above 0). Added within version 4:
    # absent, Qwen-Image's 1.
    cfg_above: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0

    @model_validator(mode="after")
    def _one_sigma_per_step(self) -> DiffusionParams:
        if self.sigmas is not None and len(self.sigmas) != self.num_inference_steps:
            raise ValueError(f"{len(self.sigmas)} sigmas for {self.num_inference_steps} steps: one per step")
        return self

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"

    @property
    def cfg(self) -> bool:
        """Classifier-free guidance runs above ``cfg_above`` (Qwen-Image's ``true_cfg_scale`` above 1, where 1
        would change nothing; Z-Image's ``guidance_scale`` above 0): the transformer then runs on the negative
        prompt's rows too, which the AR encodes for it."""
        return self.guidance_scale > self.cfg_above

    @property
    def megapixels(self) -> float:
        """Of the images it asks: what the VAE decodes and the encoder encodes, once an image."""
        return self.num_images * self.width * self.height / 1e6

    @property
    def work(self) -> float:
        """Its denoising, in the unit admission prices it in: images x steps x megapixels, twice with CFG (the
        transformer's work grows with each; a model's attention grows faster than its pixels, so the measured
        pace, per unit, is what keeps the estimate honest for the sizes a pair serves)."""
        return self.megapixels * self.num_inference_steps * (2 if self.cfg else 1)
