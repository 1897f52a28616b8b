"""The public API's models: OpenAI's Images API shapes plus ardit's documented extensions.

Request fields follow OpenAI's ``ImageGenerateParams`` and ``ImageEditParams`` (every field of the
openai package's types is accepted; what each does here is in the README); ardit's extras
(``seed``, ``num_inference_steps``, ``guidance_scale``, ``negative_prompt``, ``max_new_tokens``,
``cache_salt``, and ``strength`` for edits) come in the same body, as the official client's
``extra_body`` sends them. Types are JSON's own (``"stream": "yes"`` and ``"n": "2"`` are errors;
``"n": 2.0`` is the integer 2, as JSON Schema says) and unknown fields are refused, as OpenAI does;
an edit's form fields are typed from strings first (``edit_form``). Responses are typed models,
serialised without ``None`` fields.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictStr

Quality = Literal["auto", "low", "medium", "high", "xhigh", "max", "standard", "hd"]
# What a request may name; gif and svg are refused by the DiT's announced output formats.
RequestedFormat = Literal["png", "jpeg", "webp", "gif", "svg"]
OutputFormat = Literal["png", "jpeg", "webp"]
# Digits only, at most 5 a side: no int() of a 4,300-digit or non-ASCII "digit" string.
SIZE_PATTERN = r"^(auto|[0-9]{1,5}x[0-9]{1,5})$"
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


class ImageRequest(_Request):
    """The fields generations and edits share."""

    prompt: Annotated[StrictStr, Field(min_length=1, max_length=32000)]
    model: StrictStr | None = None
    n: Annotated[Integer, Field(ge=1, le=10)] = 1
    size: Annotated[StrictStr, Field(pattern=SIZE_PATTERN)] = "auto"
    quality: Quality = "auto"
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: RequestedFormat = "png"
    output_compression: Annotated[Integer, Field(ge=0, le=100)] | None = None
    background: Literal["auto", "opaque", "transparent"] = "auto"
    user: Annotated[StrictStr, Field(max_length=256)] | None = None
    safety_identifier: Annotated[StrictStr, Field(max_length=256)] | None = None
    stream: StrictBool = False
    partial_images: Annotated[Integer, Field(ge=0, le=3)] = 0
    # Accepted and unused here: no planning stage (complexity), no GIF or SVG output.
    complexity: Literal["low", "medium", "high"] | None = None
    frame_count: Annotated[Integer, Field(ge=2, le=16)] | None = None
    frame_duration_ms: Annotated[Integer, Field(ge=1)] | None = None
    svg: SvgOptions | None = None
    # ardit extensions
    seed: Annotated[Integer, Field(ge=0, le=2**63 - 1)] | None = None
    num_inference_steps: Annotated[Integer, Field(ge=1)] | None = None
    guidance_scale: Annotated[Number, Field(ge=0.0)] | None = None
    negative_prompt: Annotated[StrictStr, Field(max_length=32000)] | None = None
    max_new_tokens: Annotated[Integer, Field(ge=1)] | None = None
    cache_salt: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None

    @property
    def echoed_quality(self) -> str | None:
        """``quality`` as the response reports it (None where OpenAI reports none)."""
        return self.quality if self.quality in _ECHOED_QUALITY else None

    @property
    def effective_safety_identifier(self) -> str | None:
        """OpenAI's rule: a non-empty ``safety_identifier``, else the deprecated ``user``."""
        return self.safety_identifier or self.user or None


class ImageGenerationRequest(ImageRequest):
    # Accepted and unused here: no moderation pass, no DALL·E 3 styles.
    moderation: Literal["auto", "low"] | None = None
    style: Literal["vivid", "natural"] | None = None


class ImageEditRequest(ImageRequest):
    """An edit's form fields (the image, mask and markup files are not fields: ``edit_form``)."""

    # How closely the result keeps to the input when ``strength`` is not given (README).
    input_fidelity: Literal["high", "low"] | None = None
    # ardit extension: diffusers' img2img strength, the part of the schedule that is re-run.
    strength: Annotated[Number, Field(ge=0.0, le=1.0)] | None = None


class RenderRequest(BaseModel):
    """What a prefix-aware router posts to ``/v1/completions/render``: the request it is routing
    (an image request here; extra fields are the router's business and ignored)."""

    model_config = ConfigDict(extra="ignore")

    prompt: Annotated[StrictStr, Field(min_length=1, max_length=32000)]
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


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "ardit"
    # ardit extension: what the image model is (announced by the DiT).
    description: str | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
