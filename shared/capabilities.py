"""What a DiT announces about itself, in the body of its ``/readyz`` when ready.

The DiT owns every fact about what it can render (sizes, steps, guidance, images per request,
conditioning length), its defaults and its capacity. The AR reads the announcement when the DiT
becomes ready (at start and after every reconnect) and checks public requests against it before
any engine work, so no limit is configured twice. The DiT still enforces every limit on ``open``
(the same ``DiffusionLimits.check``): the announcement lets the AR refuse early, it is not what
makes the DiT safe.

JSON, not msgpack: it is small, read every few seconds at most, and operators read it with curl.
Receivers ignore keys they do not know, like the handoff frames.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field

from shared.diffusion import (
    MAX_PARTIAL_IMAGES,
    MAX_SEED,
    DiffusionParams,
    OutputFormat,
    ReferencePictureRules,
    Size,
    StepCache,
    StepCacheMethod,
    edit_steps,
    parse_size,
)
from shared.errors import InvalidDiffusionParams
from shared.frame_types import NonNegInt, PosInt, WireModel
from shared.frames import EditSpec
from shared.row_recipe import RowRecipe

# How a limit of several DiTs combines into what every one of them can do (``DiffusionLimits.common``):
# each limit field names its rule in its metadata.
Merge = Callable[[Sequence[Any]], Any]
TIGHTEST_MAX: Merge = min
TIGHTEST_MIN: Merge = max


def _every_multiple(values: Sequence[int]) -> int:
    return math.lcm(*values)


def _every(values: Sequence[bool]) -> bool:
    return all(values)


def _in_all(values: Sequence[list[Any]]) -> list[Any]:
    return [f for f in values[0] if all(f in v for v in values)]


def _in_all_that_list(values: Sequence[list[Any] | None]) -> list[Any] | None:
    """A DiT that lists nothing takes any value (within its other limits); the lists of the others meet."""
    lists = [v for v in values if v is not None]
    return _in_all(lists) if lists else None


def _all_alike(values: Sequence[Any]) -> Any:
    """One value all have; None where they differ (then none of them is offered)."""
    return values[0] if all(v == values[0] for v in values) else None


def _one_of(values: Sequence[str]) -> str:
    """OpenAI's way of listing the values a parameter takes: "'a', 'b', and 'c'"."""
    quoted = [f"'{v}'" for v in values]
    if len(quoted) <= 2:
        return " and ".join(quoted)
    return ", ".join(quoted[:-1]) + f", and {quoted[-1]}"


class DiffusionLimits(WireModel):
    # Pixel sizes must be multiples of this (VAE factor x patch size), or diffusers rounds them down.
    size_multiple: Annotated[PosInt, _every_multiple]
    max_pixels: Annotated[PosInt, TIGHTEST_MAX]
    min_inference_steps: Annotated[PosInt, TIGHTEST_MIN]
    max_inference_steps: Annotated[PosInt, TIGHTEST_MAX]
    max_guidance_scale: Annotated[float, Field(ge=0.0), TIGHTEST_MAX]
    max_images: Annotated[PosInt, TIGHTEST_MAX]
    # Most rows that may condition one image (the prompt's rows after the template prefix).
    max_conditioning_rows: Annotated[PosInt, TIGHTEST_MAX]
    output_formats: Annotated[list[OutputFormat], _in_all]
    # The step caches this DiT runs (none where several runs share the transformer); absent from a DiT
    # that predates them, which then runs none.
    step_caches: Annotated[list[StepCacheMethod], _in_all] = Field(default_factory=list)
    # The sizes the model draws well (its card's), the default first; None: any size within the limits
    # above. Another size is refused, as OpenAI refuses a size a model does not support.
    sizes: Annotated[list[Size] | None, _in_all_that_list] = None
    # Previews a request may ask for (0 where the service cannot decode the family's latents: FLUX.2 [klein]'s),
    # and whether it edits images (False where the family runs no edit pipeline: Qwen-Image-2.1's); as its model
    # card says. A DiT that predates them does both.
    max_partial_images: Annotated[NonNegInt, TIGHTEST_MAX] = MAX_PARTIAL_IMAGES
    edits: Annotated[bool, _every] = True
    # What it draws from, as its model card says (absent from a DiT that predates them: Qwen-Image's): from text
    # alone (an edit model's pipeline may not); the most pictures one edit gives (0: no edits; 1 where an edit starts
    # from one picture); whether an edit may bring a mask (an inpaint pipeline); whether an edit takes a strength
    # (img2img, inpaint) or takes none (a reference edit: the pipeline reads the pictures beside the rows).
    text_to_image: Annotated[bool, _every] = True
    max_edit_pictures: Annotated[NonNegInt, TIGHTEST_MAX] = 1
    edit_mask: Annotated[bool, _every] = True
    edit_strength: Annotated[bool, _every] = True
    # Whether an edit whose strength runs no step is answered (the input through the VAE and back, where the service
    # decodes); where the family's pipeline encodes and decodes itself, diffusers refuses it, and so does the DiT.
    edits_without_steps: Annotated[bool, _every] = True
    # How its pipeline takes reference pictures it reads itself (FLUX.2 [klein]'s; the AR's text-only encoder reads
    # none of them); None: a reference edit's pictures are its encoder's (Qwen-Image-Edit's), or it takes none.
    reference_pictures: Annotated[ReferencePictureRules | None, _all_alike] = None

    @classmethod
    def common(cls, all_limits: Sequence[DiffusionLimits]) -> DiffusionLimits:
        """What every one of these DiTs can do: each field merged by the rule it declares; DiTs that disagree on
        whether an edit takes a strength share no edit (each refuses the other's)."""
        merged = {}
        for name, field in cls.model_fields.items():
            rule = next(m for m in field.metadata if callable(m))
            merged[name] = rule([getattr(limits, name) for limits in all_limits])
        if len({limits.edit_strength for limits in all_limits}) > 1:
            merged |= {"edits": False, "max_edit_pictures": 0}
        return cls(**merged)

    def check_size(self, width: int, height: int) -> None:
        """``InvalidDiffusionParams`` (param ``size``) unless this DiT renders exactly ``width`` x ``height``."""
        multiple, size = self.size_multiple, f"{width}x{height}"
        if width < multiple or height < multiple or width % multiple or height % multiple:
            raise InvalidDiffusionParams(
                f"size {size}: width and height must be positive multiples of {multiple}", param="size"
            )
        if width * height > self.max_pixels:
            raise InvalidDiffusionParams(f"size {size} is over the {self.max_pixels}-pixel limit", param="size")
        if self.sizes is not None and size not in self.sizes:
            if not self.sizes:
                raise InvalidDiffusionParams("the ready image models share no size they all draw", param="size")
            supported = _one_of([*self.sizes, "auto"])
            raise InvalidDiffusionParams(f"Invalid value: '{size}'. Supported values are: {supported}.", param="size")

    def check(self, params: DiffusionParams) -> None:
        """``InvalidDiffusionParams`` naming the public parameter unless this DiT renders ``params``
        exactly as asked. The AR checks a request with it before any work, the DiT every ``open``."""
        self.check_size(params.width, params.height)
        steps, fewest, most = params.num_inference_steps, self.min_inference_steps, self.max_inference_steps
        if not fewest <= steps <= most:
            # With a custom schedule the steps are its sigmas: the request named them there.
            param = "num_inference_steps" if params.sigmas is None else "sigmas"
            raise InvalidDiffusionParams(f"{steps} steps are not within [{fewest}, {most}]", param=param)
        if params.num_images > self.max_images:
            raise InvalidDiffusionParams(f"n {params.num_images} is over {self.max_images}", param="n")
        if params.seed + params.num_images - 1 > MAX_SEED:
            raise InvalidDiffusionParams(f"seed {params.seed} + n - 1 is over {MAX_SEED}", param="seed")
        guidance = params.guidance_scale
        if not math.isfinite(guidance) or guidance > self.max_guidance_scale:
            raise InvalidDiffusionParams(
                f"guidance_scale {guidance} is not within [0, {self.max_guidance_scale}]", param="guidance_scale"
            )
        if params.step_cache is not None and params.step_cache.method not in self.step_caches:
            offered = ", ".join(self.step_caches) or "none"
            raise InvalidDiffusionParams(
                f"step_cache method {params.step_cache.method!r} is not run here (offered: {offered})",
                param="step_cache",
            )
        if params.partial_images > self.max_partial_images:
            raise InvalidDiffusionParams(
                f"partial_images {params.partial_images}: this image model renders at most "
                f"{self.max_partial_images} previews",
                param="partial_images",
            )
        if params.output_format not in self.output_formats:
            raise InvalidDiffusionParams(
                f"output_format {params.output_format!r} is not supported here", param="output_format"
            )

    def check_edit(self, edit: EditSpec | None) -> None:
        """``InvalidDiffusionParams`` naming the public parameter unless this DiT draws from what ``edit`` gives
        (None: text alone): as many pictures, a mask, a strength. The DiT checks every ``open`` with it."""
        if edit is None:
            if not self.text_to_image:
                raise InvalidDiffusionParams(
                    "this image model draws from pictures, not from text alone: send an image to edit", param="image"
                )
            return
        if not self.edits:
            raise InvalidDiffusionParams("this image model does not edit images", param="image")
        if len(edit.pictures) > self.max_edit_pictures:
            raise InvalidDiffusionParams(
                f"{len(edit.pictures)} images: this image model edits at most {self.max_edit_pictures}", param="image"
            )
        if edit.mask and not self.edit_mask:
            raise InvalidDiffusionParams("this image model takes no mask", param="mask")
        # An inpaint takes a strength wherever it runs; without a mask, an img2img does and a reference edit does not.
        takes_strength = self.edit_strength or edit.mask
        if edit.strength is not None and not takes_strength:
            raise InvalidDiffusionParams(
                "this image model takes no strength without a mask: it reads the images beside the prompt",
                param="strength",
            )
        if edit.strength is None and takes_strength:
            raise InvalidDiffusionParams(
                "this image model edits from an image noised to a strength: give one", param="strength"
            )
        if self.reference_pictures is not None:
            for n, picture in enumerate(edit.pictures, start=1):
                if (why := self.reference_pictures.refusal(picture.width, picture.height)) is not None:
                    raise InvalidDiffusionParams(f"picture {n} {why}", param="image")

    def check_edit_steps(self, strength: float | None, num_inference_steps: int) -> None:
        """``InvalidDiffusionParams`` naming ``strength`` where it runs no step of the schedule and this DiT's
        pipeline refuses that (``edits_without_steps``)."""
        if strength is not None and not self.edits_without_steps and edit_steps(num_inference_steps, strength) == 0:
            raise InvalidDiffusionParams(
                f"strength {strength} runs no step of {num_inference_steps}; this image model's pipeline needs one",
                param="strength",
            )


class DiffusionDefaults(WireModel):
    """What the model renders best when a request does not say."""

    width: PosInt
    height: PosInt
    num_inference_steps: PosInt
    guidance_scale: Annotated[float, Field(ge=0.0)]
    step_cache: StepCache | None = None
    # The negative prompt CFG runs against when a request gives none (Qwen-Image's " "); a DiT that predates
    # it announces none, and gets Qwen-Image's.
    negative_prompt: Annotated[str, Field(max_length=4096)] = " "

    def params(self, num_inference_steps: int | None = None, cfg_above: float = 1.0) -> DiffusionParams:
        """The default request's diffusion parameters (``num_inference_steps``: another step count), guided above
        ``cfg_above`` as the DiT announces it."""
        return DiffusionParams(
            width=self.width,
            height=self.height,
            num_inference_steps=num_inference_steps or self.num_inference_steps,
            guidance_scale=self.guidance_scale,
            seed=0,
            cfg_above=cfg_above,
        )


@dataclass(frozen=True)
class Load:
    """What requests ask of the pair, in the three parts their time grows with: ``requests`` (each costs the same
    whatever it asks: the AR's engine, the handoff), ``megapixels`` (of the images they ask, each decoded by the VAE
    and encoded) and ``work`` (their denoising, ``DiffusionParams.work``)."""

    requests: int = 0
    megapixels: float = 0.0
    work: float = 0.0

    @classmethod
    def of(cls, params: DiffusionParams) -> Load:
        return cls(1, params.megapixels, params.work)

    def __add__(self, other: Load) -> Load:
        return Load(self.requests + other.requests, self.megapixels + other.megapixels, self.work + other.work)

    def __sub__(self, other: Load) -> Load:
        return Load(self.requests - other.requests, self.megapixels - other.megapixels, self.work - other.work)


class Pace(WireModel):
    """What a load costs in time: seconds for each request, megapixel and unit of work it holds."""

    per_request: Annotated[float, Field(ge=0)]
    # A DiT that predates it announces none: its megapixels cost nothing apart from their work.
    per_megapixel: Annotated[float, Field(ge=0)] = 0.0
    per_work: Annotated[float, Field(ge=0)]

    def seconds(self, load: Load) -> float:
        return load.requests * self.per_request + load.megapixels * self.per_megapixel + load.work * self.per_work

    def scaled(self, factor: float) -> Pace:
        return Pace(
            per_request=self.per_request * factor,
            per_megapixel=self.per_megapixel * factor,
            per_work=self.per_work * factor,
        )


class DitCapacity(WireModel):
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
        """Requests one sender may have at this DiT at once without being refused: each holds one place
        from its reservation (or its handoff's arrival) to the end of its pipeline run."""
        return min(self.max_admitted, self.max_concurrent_handoffs)


class DitCapabilities(WireModel):
    model: Annotated[str, Field(min_length=1, max_length=256)]
    description: str
    # The width of the rows this DiT is conditioned on (the key ``hidden_size`` until the next schema version).
    row_width: PosInt = Field(alias="hidden_size")
    # How its rows are read from the AR's model (its card's, ``shared.row_recipe``): the AR captures exactly that.
    # None: not known (a DiT-only folder without a card), any one layer is taken.
    rows: RowRecipe | None = None
    # The conditioning adapters it knows (``rows.conditioning`` is one of them where rows are known).
    conditioning: list[str]
    # The guidance scale its pipeline runs classifier-free guidance above (``DiffusionParams.cfg_above``): its
    # family's, 1 for Qwen-Image (absent from a DiT that predates it), 0 for Z-Image.
    cfg_above: Annotated[float, Field(ge=0.0)] = 1.0
    limits: DiffusionLimits
    defaults: DiffusionDefaults
    capacity: DitCapacity
    # This DiT's pace, from its timed warm-up renders (``dit_service.model_state``): what the AR prices waits at
    # until it has measured the pair's own, and the split of a request's time into its parts after that. None: not
    # measured (a DiT that predates it).
    pace: Pace | None = None

    def default_params(self, num_inference_steps: int | None = None) -> DiffusionParams:
        """The default request's diffusion parameters, as this DiT guides them."""
        return self.defaults.params(num_inference_steps, self.cfg_above)

    @classmethod
    def common(cls, all_capabilities: Sequence[DitCapabilities]) -> DitCapabilities:
        """What every one of these DiTs can do: the first's identity, defaults and measured pace, the tightest
        limits (and for ``auto`` the first size they all draw, where they list sizes and the first's default is
        not one)."""
        first = all_capabilities[0]
        if all(c == first for c in all_capabilities):
            return first
        limits = DiffusionLimits.common([c.limits for c in all_capabilities])
        defaults = first.defaults
        if limits.sizes and f"{defaults.width}x{defaults.height}" not in limits.sizes:
            width, height = parse_size(limits.sizes[0])
            defaults = defaults.model_copy(update={"width": width, "height": height})
        return first.model_copy(update={"limits": limits, "defaults": defaults})
