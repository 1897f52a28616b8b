"""The public API's models: OpenAI's Images API shapes plus ardit's documented extensions.

Request fields follow OpenAI's ``ImageGenerateParams`` and ``ImageEditParams`` (every field of the
openai package's types is accepted); ardit's extras come in the same body, as the official
client's ``extra_body`` sends them. Each field's ``description`` says what it does here: the API
reference (docs/api.md) is generated from them. Bounds shared with the handoff and the DiT
(seed, size pattern, output formats, previews) come from ``shared.diffusion``. Types are JSON's own
(``"stream": "yes"`` and ``"n": "2"`` are errors; ``"n": 2.0`` is the integer 2, as JSON Schema
says) and unknown fields are refused, as OpenAI does; an edit's form fields are typed from strings
first (``edit_form``). Responses are typed models, serialised without ``None`` fields.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictStr

from shared.diffusion import (
    FIRST_BLOCK_THRESHOLD,
    MAX_IMAGES,
    MAX_PARTIAL_IMAGES,
    MAX_SEED,
    SIZE,
    TAYLORSEER_INTERVAL,
    FirstBlockCache,
    OutputFormat,
    Sigmas,
    StepCache,
    TaylorSeerCache,
)

Quality = Literal["auto", "low", "medium", "high", "xhigh", "max", "standard", "hd"]
# Denoising steps by quality when the request names no steps; "auto" (and "standard") take the DiT's announced
# default. Quality is the knob OpenAI clients have.
STEPS_BY_QUALITY = {"low": 4, "medium": 8, "high": 20, "hd": 20, "xhigh": 30, "max": 50}
# What a request may name: the output formats, and OpenAI's two this model cannot produce.
RequestedFormat = Literal[OutputFormat, "gif", "svg"]
MAX_PROMPT_CHARS = 32_000
# OpenAI's quality values that are echoed back; the rest ("auto", "standard", "hd") are not.
_ECHOED_QUALITY = ("low", "medium", "high", "xhigh", "max")


def _json_integer(value: object) -> object:
    """JSON's integers, as JSON Schema means them (7 and 7.0), and nothing a lax parser would
    coerce (``"7"``, ``true``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("must be an integer")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError("must be an integer")
    return int(value)


def _json_number(value: object) -> object:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("must be a number")
    return value


Integer = Annotated[int, BeforeValidator(_json_integer)]
Number = Annotated[float, BeforeValidator(_json_number)]
Prompt = Annotated[StrictStr, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]


class _Request(BaseModel):
    # Lax parsing with typed guards (StrictStr/StrictBool, Integer, Number): what JSON Schema
    # calls valid is accepted, and nothing is coerced from another JSON type.
    model_config = ConfigDict(extra="forbid")


class SvgReasoning(_Request):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None


class SvgOptions(_Request):
    """OpenAI's ``svg`` (for ``output_format=svg``, which this model cannot produce): accepted, unused."""

    model: StrictStr | None = None
    reasoning: SvgReasoning | None = None


class FirstBlockCacheRequest(_Request):
    """Skip the other blocks while the first block's residual changes by less than ``threshold``."""

    method: Literal["first_block"]
    threshold: Annotated[Number, FIRST_BLOCK_THRESHOLD]

    def on_wire(self) -> StepCache:
        return FirstBlockCache(method=self.method, threshold=float(self.threshold))


class TaylorSeerCacheRequest(_Request):
    """A full transformer pass every ``interval`` steps; attention extrapolated between them."""

    method: Literal["taylorseer"]
    interval: Annotated[Integer, TAYLORSEER_INTERVAL]

    def on_wire(self) -> StepCache:
        return TaylorSeerCache(method=self.method, interval=self.interval)


class NoStepCacheRequest(_Request):
    """Every step runs the whole transformer, whatever the model's default."""

    method: Literal["none"]

    def on_wire(self) -> None:
        return None


StepCacheRequest = Annotated[
    FirstBlockCacheRequest | TaylorSeerCacheRequest | NoStepCacheRequest, Field(discriminator="method")
]
_UNUSED = "Accepted and ignored: {}."


class ImageRequest(_Request):
    """The fields generations and edits share."""

    prompt: Prompt = Field(
        description=f"The text the AR encodes (at most {MAX_PROMPT_CHARS:,} characters); its rows after the "
        "template condition the DiT."
    )
    model: StrictStr | None = Field(None, description="`ardit` (or omitted); anything else is a `404 model_not_found`.")
    n: Annotated[Integer, Field(ge=1, le=MAX_IMAGES)] = Field(
        1, description="Images, 1 up to the DiT's announced limit; image *i* uses seed `seed + i`."
    )
    size: Annotated[StrictStr, Field(pattern=f"^(auto|{SIZE})$")] = Field(
        "auto",
        description="`WxH`: one of the sizes the model card lists (others get a 400 that names them), or, for a "
        "model that lists none, any multiple of the DiT's size multiple within its pixel limit. `auto`: the DiT's "
        "default size (generations); for edits the listed size nearest the input image's shape, or for a model "
        "that lists none the input's size scaled down to the pixel limit and rounded down to the multiple. "
        "Responses and events report the rendered `WxH`, never `auto`.",
    )
    quality: Quality = Field(
        "auto",
        description="Sets the default steps ("
        + ", ".join(f"`{quality}` {steps}" for quality, steps in STEPS_BY_QUALITY.items())
        + "; `auto`/`standard`: the DiT's default); echoed where OpenAI echoes it.",
    )
    response_format: Literal["b64_json", "url"] = Field(
        "b64_json",
        description="`b64_json`, or `url`: a link to `GET /v1/images/{name}`, kept for "
        "`ARDIT_AR_IMAGE_TTL_SECONDS` within the store's count and byte bounds.",
    )
    output_format: RequestedFormat = Field(
        "png", description="`png` / `jpeg` / `webp` (those the DiT announces); `gif` and `svg` are refused."
    )
    output_compression: Annotated[Integer, Field(ge=0, le=100)] | None = Field(
        None, description="JPEG/WebP quality 0-100 (not for PNG)."
    )
    background: Literal["auto", "opaque", "transparent"] = Field(
        "auto",
        description="`auto` / `opaque`; `transparent` is refused. Every picture is opaque: one a model draws with "
        "alpha (Qwen-Image-2.1's VAE decodes RGBA) is served over white, in every format.",
    )
    user: Annotated[StrictStr, Field(max_length=256)] | None = Field(
        None, description="Echoed as `safety_identifier` when that is not given."
    )
    safety_identifier: Annotated[StrictStr, Field(max_length=256)] | None = Field(
        None, description="Echoed (OpenAI's rule: a non-empty `safety_identifier`, else `user`)."
    )
    stream: StrictBool = Field(False, description="Server-sent events: previews, then one completed event per image.")
    partial_images: Annotated[Integer, Field(ge=0, le=MAX_PARTIAL_IMAGES)] = Field(
        0,
        description=f"Previews (0-{MAX_PARTIAL_IMAGES}) while streaming, before the final image, where the image "
        "model runs them (Qwen-Image, the demo, Z-Image); FLUX.2 [klein] announces 0, and more is a 400 naming "
        "`partial_images`.",
    )
    complexity: Literal["low", "medium", "high"] | None = Field(None, description=_UNUSED.format("no planning stage"))
    frame_count: Annotated[Integer, Field(ge=2, le=16)] | None = Field(None, description=_UNUSED.format("no GIF"))
    frame_duration_ms: Annotated[Integer, Field(ge=1)] | None = Field(None, description=_UNUSED.format("no GIF"))
    svg: SvgOptions | None = Field(None, description=_UNUSED.format("no SVG output"))
    # ardit extensions
    seed: Annotated[Integer, Field(ge=0, le=MAX_SEED)] | None = Field(
        None, description="The DiT's seed for image 0 (default: derived from the request id, so it is in the logs)."
    )
    num_inference_steps: Annotated[Integer, Field(ge=1)] | None = Field(
        None, description="The schedule's length, within the DiT's announced range."
    )
    sigmas: Sigmas[Number] | None = Field(
        None,
        description="A custom noise schedule: strictly decreasing noise levels in (0, 1], one per step (diffusers' "
        "`sigmas`, before the scheduler's shift and terminal stretch); the number of steps is their count, within "
        "the DiT's range.",
    )
    guidance_scale: Annotated[Number, Field(ge=0.0)] | None = Field(
        None,
        description="Classifier-free guidance, as the image model's pipeline means it: above the scale the DiT "
        "announces (`cfg_above`: 1 for Qwen-Image's true_cfg_scale, 0 for Z-Image) the AR encodes the negative "
        "prompt too (default: the DiT's).",
    )
    step_cache: StepCacheRequest | None = Field(
        None,
        description="Skip transformer work between denoising steps with one of diffusers' cache hooks: "
        '`{"method": "first_block", "threshold": 0.1}` or `{"method": "taylorseer", "interval": 3}` (methods the '
        'DiT announces), or `{"method": "none"}`; faster, and further from the uncached picture (default: the '
        "model card's; see benchmarks/results/step_cache.md).",
    )
    negative_prompt: Annotated[StrictStr, Field(max_length=MAX_PROMPT_CHARS)] | None = Field(
        None,
        description="What CFG steers away from (default: `ARDIT_AR_DEFAULT_NEGATIVE_PROMPT`, else the DiT's, its "
        'model card\'s: Qwen-Image\'s `" "`, Z-Image\'s `""`); ignored, and not encoded, where `guidance_scale` runs '
        "no CFG (1 or less for Qwen-Image, 0 for Z-Image).",
    )
    max_new_tokens: Annotated[Integer, Field(ge=1)] | None = Field(
        None,
        description="More than 1 makes the AR generate (MammothModa2-style); the text comes back as `revised_prompt`.",
    )
    cache_salt: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = Field(
        None, description="vLLM's prefix-cache salt."
    )

    @property
    def echoed_quality(self) -> str | None:
        """``quality`` as the response reports it (None where OpenAI reports none)."""
        return self.quality if self.quality in _ECHOED_QUALITY else None

    @property
    def effective_safety_identifier(self) -> str | None:
        """OpenAI's rule: a non-empty ``safety_identifier``, else the deprecated ``user``."""
        return self.safety_identifier or self.user or None


class ImageGenerationRequest(ImageRequest):
    moderation: Literal["auto", "low"] | None = Field(None, description=_UNUSED.format("no moderation pass"))
    style: Literal["vivid", "natural"] | None = Field(None, description=_UNUSED.format("no DALL·E style"))


class ImageEditRequest(ImageRequest):
    """An edit's form fields (the image, mask and markup files are not fields: ``edit_form``)."""

    input_fidelity: Literal["high", "low"] | None = Field(
        None,
        description="The default `strength`: `low` (the default) 0.6, `high` 0.3. Refused by a model that takes no "
        "strength (an edit model whose encoder reads the pictures).",
    )
    strength: Annotated[Number, Field(ge=0.0, le=1.0)] | None = Field(
        None,
        description="diffusers' img2img strength: the last ceil(steps * strength) steps of the schedule run from the "
        "noised input; 0 returns the input through the VAE and back (Qwen-Image; a model whose pipeline decodes its "
        "own picture, Z-Image's, refuses 0, as diffusers does), 1 starts from noise. Refused by a model that takes no "
        "strength (an edit model whose encoder reads the pictures).",
    )


class RenderRequest(BaseModel):
    """What a prefix-aware router posts to ``/v1/completions/render``: the request it is routing
    (an image request here; extra fields are the router's business and ignored)."""

    model_config = ConfigDict(extra="ignore")

    prompt: Prompt
    model: StrictStr | None = None


class RenderedPrompt(BaseModel):
    """vLLM's ``GenerateRequest`` shape: the token ids the engine will see (and cache)."""

    model_config = ConfigDict(frozen=True)

    request_id: str
    token_ids: list[int]


class _Response(BaseModel):
    model_config = ConfigDict(frozen=True)


class InputTokensDetails(_Response):
    text_tokens: int
    image_tokens: int = 0
    # Where OpenAI/vLLM clients look for prefix-cache hits.
    cached_tokens: int


class OutputTokensDetails(_Response):
    text_tokens: int
    image_tokens: int = 0


class Usage(_Response):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int
    # ardit extensions: vLLM's prefix-cache counts for this request (all streams).
    cached_tokens: int
    cache_creation_tokens: int


class ImageData(_Response):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None


class ImagesResponse(_Response):
    created: int
    data: list[ImageData]
    background: Literal["opaque"] = "opaque"
    output_format: OutputFormat
    # The rendered size as WIDTHxHEIGHT, always (also for size=auto): the client's types take any string.
    size: str
    quality: str | None = None
    safety_identifier: str | None = None
    usage: Usage


# Stream events are named by the operation: ``image_generation.*`` or ``image_edit.*``.
EventPrefix = Literal["image_generation", "image_edit"]


class PartialImageEvent(_Response):
    type: Literal["image_generation.partial_image", "image_edit.partial_image"]
    b64_json: str
    created_at: int
    partial_image_index: int
    # ardit extension: which of the request's n images this preview is of (0 .. n-1).
    image_index: int
    background: Literal["opaque"] = "opaque"
    output_format: OutputFormat
    quality: str
    size: str


class CompletedEvent(_Response):
    type: Literal["image_generation.completed", "image_edit.completed"]
    b64_json: str
    created_at: int
    background: Literal["opaque"] = "opaque"
    output_format: OutputFormat
    quality: str
    size: str
    safety_identifier: str | None = None
    usage: Usage


class ModelObject(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "ardit"
    # ardit extensions, announced by the DiTs: what the image model is, and the sizes it draws (`size` takes
    # these and `auto`; None: any size within the DiTs' limits).
    description: str | None = None
    sizes: list[str] | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelObject]
