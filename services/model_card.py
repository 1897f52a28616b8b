"""A diffusers family's model card: the one record of what ardit knows about it, one card per family.

A family is a diffusers pipeline class, as a folder's ``model_index.json`` names it (``_class_name``, what diffusers
itself loads). Its card says, as data, everything both services need: which pipeline runs each kind of render and
how it takes the rows (the DiT maps the class names to classes), which of ardit's features it runs, how its
``encode_prompt`` reads the text encoder (``rows``, the AR captures exactly that), and the defaults its authors
publish. Adding a family is adding its card to ``CARDS``; this module imports no diffusers, so the AR reads the same
cards.

The pipeline's facts are the family's. The published part (description, defaults, sizes, ``cpu_threads``,
``rows``) is the folder's: a folder made for ardit replaces it with its own ``ardit.json`` (the trained demo's
does); a folder as its authors published it, which ships its text encoder, keeps the family's; a folder with
neither (a DiT-only folder such as the plumbing model) has none, and the services' settings and fallbacks describe
it. Rows are read by the folder's recipe, else, where it ships a text encoder, by the family's; a DiT-only folder
without ``ardit.json`` reads any one layer (``rows`` None). Layers counted from the end are resolved against the
folder's text encoder.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.diffusion import STEP_CACHE_METHODS, ReferencePictureRules, Size, StepCache, StepCacheMethod
from shared.row_recipe import QWEN_IMAGE_21_SYSTEM, QWEN_IMAGE_21_TEMPLATE, QWEN_IMAGE_EDIT_TEMPLATE, RowRecipe

MODEL_CARD_FILE = "ardit.json"
PIPELINE_INDEX = "model_index.json"

# The kinds of render: from text alone; from one picture noised to a strength (img2img, inpaint); from reference
# pictures the pipeline encodes itself, each at its own size, beside the rows of an encoder that read them too.
PipelineKind = Literal["text_to_image", "image_to_image", "inpaint", "reference_edit"]
# How a family's pipeline takes the rows as ``prompt_embeds``:
# - "padded_with_mask": [B, L, D] right-padded to the longest, with ``prompt_embeds_mask`` (Qwen-Image);
# - "list_of_rows": one [L_i, D] tensor of each image's own rows (Z-Image, as its ``encode_prompt`` gives them);
# - "rows": [B, L, D] of the rows alone, no padding (FLUX.2: its transformer would attend to pad rows).
PromptEmbedsForm = Literal["padded_with_mask", "list_of_rows", "rows"]
# Whose latents the service decodes itself, by the arithmetic of that pipeline's ``__call__``: Qwen-Image's packed
# latents (``dit_service.vae_codec``), Z-Image's (``dit_service.z_image_latents``).
LatentLayout = Literal["qwen_image", "z_image"]


class PictureReading(BaseModel):
    """How a family's pipeline reads the user's pictures (``QwenImageEditPlusPipeline``'s ``__call__``): each picture is
    resized, at its aspect, to ``condition_area`` for the text encoder's vision tower and to ``vae_area`` for the VAE,
    sides rounded to ``multiple`` (its ``calculate_dimensions``); the prompt is ``picture_prompt`` once per picture,
    numbered from 1, then the user's text. ``max_pictures``: the most one request gives, chosen by the memory of a
    render (docs/models.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    condition_area: int = Field(gt=0)
    vae_area: int = Field(gt=0)
    multiple: int = Field(gt=0)
    picture_prompt: str
    max_pictures: int = Field(ge=1)

    @property
    def condition_side(self) -> int:
        """The side of a square picture of the condition area: what the vision tower's memory is sized with."""
        return math.isqrt(self.condition_area)

    def condition_size(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) a ``width`` x ``height`` picture is read at by the vision tower."""
        return self._area_size(self.condition_area, width, height)

    def vae_size(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) a ``width`` x ``height`` picture is VAE-encoded at (and, for the last one, the output
        size the pipeline draws when it is given none)."""
        return self._area_size(self.vae_area, width, height)

    def prompt(self, pictures: int, text: str) -> str:
        return "".join(self.picture_prompt.format(n) for n in range(1, pictures + 1)) + text

    def _area_size(self, area: int, width: int, height: int) -> tuple[int, int]:
        ratio = width / height
        wide = math.sqrt(area * ratio)
        m = self.multiple
        return round(wide / m) * m, round(wide / ratio / m) * m


class ModelCard(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # --- the family's pipeline: fixed per family, not a folder's to change
    # The pipeline class, as ``model_index.json`` names it.
    family: str
    # The pipeline class of each kind of render it runs (an edit model's pipeline may run no text to image).
    pipelines: dict[PipelineKind, str]
    # Its text encoder reads the user's pictures (the AR then serves its vision tower); None: text only.
    reads_pictures: PictureReading | None = None
    # How its reference-edit pipeline takes the pictures it reads itself, beside a text-only encoder's rows (FLUX.2
    # [klein]'s); None where its encoder reads them (``reads_pictures``) or it runs no reference edit.
    reference_pictures: ReferencePictureRules | None = None
    # The transformer config key that holds its row width.
    row_width_key: str = "joint_attention_dim"
    prompt_embeds: PromptEmbedsForm
    # The service decodes the pipeline's latents itself, as edits need; else the pipeline decodes its own picture.
    service_decodes: bool = False
    # Whose latents the service decodes (previews, and finals where it decodes them); None: none, so no previews.
    latents: LatentLayout | None = None
    # Jobs may share a pipeline run (the pipeline masks rows of different lengths).
    batches: bool
    # The step-cache methods diffusers' hooks run on its transformer.
    step_caches: tuple[StepCacheMethod, ...] = ()
    # The most guidance its pipeline renders as asked (inf: no cap beyond the operator's).
    max_guidance_scale: float = math.inf
    # Its pipeline runs classifier-free guidance at a guidance scale above this (``DiffusionParams.cfg_above``), against
    # the AR's negative rows.
    cfg_above: float = 1.0
    # The most conditioning rows a request gives it (the DiT's ``max_sequence_length`` unless the operator sets one):
    # the pipelines' own default, 512; an edit model's rows hold its pictures' tokens too.
    max_rows: int = Field(512, ge=1, le=1024)
    # The loaded pipeline's own config options each request's pipeline is built with too.
    pipeline_options: tuple[str, ...] = ()
    # Its pipeline reads its processor when it is built (Qwen-Image-2.1's measures the system message it drops with
    # it), so the DiT loads that (a tokenizer and image settings, no weights); else the DiT loads no text-side part.
    pipeline_needs_processor: bool = False

    # --- published: the family's defaults as its authors publish them, which a folder's ``ardit.json`` replaces
    description: str | None = None
    default_size: Size | None = None
    # The sizes the model draws well, decided by the judge (benchmarks/results/prompt_following_sizes); no list: any
    # size within the DiT's limits.
    sizes: list[Size] | None = None
    default_num_inference_steps: int | None = None
    # The guidance a request gets when it names none (``cfg_above`` says where that runs CFG), and the negative
    # prompt the AR encodes for CFG when a request gives none.
    default_guidance_scale: float | None = None
    default_negative_prompt: str | None = None
    # The step cache a request gets when it names none (benchmarks/results/step_cache.md decides it).
    default_step_cache: StepCache | None = None
    # torch intra-op threads the model renders fastest with on CPU, measured (benchmarks/results); None: torch's
    # default, one per core. A model whose every op is small loses more to the threads' barriers than it gains.
    cpu_threads: int | None = Field(None, ge=1)
    # How the model's rows are read from its text encoder; an ``open`` that reads them otherwise is refused.
    rows: RowRecipe | None = None

    @property
    def previews(self) -> bool:
        return self.latents is not None

    @property
    def edits(self) -> bool:
        return bool({"image_to_image", "inpaint", "reference_edit"} & self.pipelines.keys())

    @property
    def edits_without_steps(self) -> bool:
        """Whether an edit whose strength runs no step is answered (the input through the VAE and back, where the
        service decodes); diffusers' own img2img pipelines raise on it, so elsewhere it is refused."""
        return self.edits and self.service_decodes

    @property
    def loading_pipeline(self) -> str:
        """The pipeline class its weights load by: its text to image one, else its edit's (diffusers' class of that
        name; the family's own name may be a card's alone, as a folder made for ardit names it)."""
        return self.pipelines.get("text_to_image") or self.pipelines["reference_edit"]

    @property
    def text_to_image(self) -> bool:
        """Whether it draws from text alone (an edit model's pipeline may not)."""
        return "text_to_image" in self.pipelines

    @property
    def max_edit_pictures(self) -> int:
        """The most pictures one edit gives: what its pipeline reads beside the rows (a reference edit), 1 where an
        edit starts from one picture noised to a strength, 0 where it edits none."""
        if not self.edits:
            return 0
        if "reference_edit" in self.pipelines and self.reads_pictures is not None:
            return self.reads_pictures.max_pictures
        if "reference_edit" in self.pipelines and self.reference_pictures is not None:
            return self.reference_pictures.max_pictures
        return 1

    @property
    def edit_mask(self) -> bool:
        """Whether an edit may bring a mask (only its nonzero pixels repainted: an inpaint pipeline)."""
        return self.edits and "inpaint" in self.pipelines

    @property
    def edit_strength(self) -> bool:
        """Whether an edit without a mask takes a strength (img2img) rather than none (a reference edit); an edit with a
        mask (inpaint) always takes one."""
        return self.edits and "image_to_image" in self.pipelines

    @classmethod
    def read(cls, model_dir: Path) -> ModelCard:
        """The card of the family in ``model_dir``, as the folder has it, its layers counted from the start;
        ``ValueError`` for a folder of no family in ``CARDS``, an ``ardit.json`` that sets the family's own facts,
        or layers its text encoder does not have."""
        name = _json(model_dir / PIPELINE_INDEX).get("_class_name")
        if name is None:
            raise ValueError(f"{model_dir}: no {PIPELINE_INDEX} names a diffusers pipeline")
        card = CARDS.get(str(name))
        if card is None:
            raise ValueError(f"{model_dir}: a {name} pipeline; ardit serves {', '.join(CARDS)}")
        try:
            return card._as_in(model_dir)
        except ValueError as exc:
            raise ValueError(f"{model_dir}: {exc}") from None

    def _as_in(self, model_dir: Path) -> ModelCard:
        layers = _text_encoder_layers(model_dir)
        own = model_dir / MODEL_CARD_FILE
        if own.exists():
            published = _published_fields(json.loads(own.read_text()))
        elif layers is not None:
            published = self.model_dump(include=set(PUBLISHED))
        else:
            published = {}
        card = ModelCard.model_validate(self.model_dump(exclude=set(PUBLISHED)) | published)
        rows = card.rows if card.rows is not None or layers is None else self.rows
        if rows is None:
            return card
        if layers is None:
            if min(rows.layers) < 0:
                raise ValueError("its card counts layers from the end, and it ships no text encoder")
            return card
        return card.model_copy(update={"rows": rows.resolved(layers)})


# The fields a folder's ``ardit.json`` sets, all of them together.
PUBLISHED = frozenset(
    {
        "description",
        "default_size",
        "sizes",
        "default_num_inference_steps",
        "default_guidance_scale",
        "default_negative_prompt",
        "default_step_cache",
        "cpu_threads",
        "rows",
    }
)


def _published_fields(values: Any) -> dict[str, Any]:
    if not isinstance(values, dict):
        raise ValueError(f"{MODEL_CARD_FILE} is not a JSON object")
    if unknown := sorted(set(values) - PUBLISHED):
        raise ValueError(f"{MODEL_CARD_FILE} sets {unknown}: a folder sets only {sorted(PUBLISHED)}")
    return values


# The cards, by family. Each family's published part is its authors' defaults and how its ``encode_prompt`` reads
# the text encoder; its pipeline facts are what diffusers' pipelines take and run:
# - Qwen-Image runs every feature. Its model card and diffusers' QwenImagePipeline documentation render at
#   1328x1328 (its 1:1 size) in 50 steps with ``true_cfg_scale=4`` (CFG above 1) and ``negative_prompt=" "``. It
#   lists other aspect ratios too, not all of them multiples of 16, which diffusers would silently round down: no
#   list, any multiple of 16 is drawn. Rows: ``hidden_states[-1]``, its own template, the template's rows dropped.
# - Z-Image-Turbo's card and diffusers' ZImagePipeline example: 1024x1024, 9 steps, ``guidance_scale=0``; CFG runs
#   above 0, against ZImagePipeline's default negative prompt, "" (its ``encode_prompt``). Rows:
#   ``hidden_states[-2]`` (before the final norm) of the chat template with ``enable_thinking=True``, every unpadded
#   row kept. Its pipeline takes each image's rows as a list and masks them itself, so jobs batch (a batch renders
#   each picture as alone but for float rounding). Previews decode as its ``__call__`` does (four public lines). Its
#   edits are diffusers' ZImageImg2ImgPipeline (one picture noised to a strength) and ZImageInpaintPipeline (with a
#   mask; it repaints under the mask and pastes nothing back), given the picture and mask as PIL images: they encode
#   and decode themselves, so a strength that runs no step is refused, as they refuse it. Its transformer has no
#   ``CacheMixin``, so no step caches.
# - FLUX.2 [klein]'s distilled models and diffusers' Flux2KleinPipeline example: 1024x1024, 4 steps,
#   ``guidance_scale=1``; a distilled model ignores guidance (diffusers only warns), so more is refused. Rows:
#   ``hidden_states`` 9, 18 and 27 side by side, chat template with ``enable_thinking=False``. diffusers pads the
#   prompt to 512 tokens and keeps the pads' rows, computed under a padding mask; a causal engine cannot compute
#   those (each pad would attend to the prompt alone at its own position), so the real rows condition it, the rows
#   it computes exactly (benchmarks/results/flux2_pad_rows.md). Its transformer takes no mask over the
#   rows, so jobs do not batch; its latents unpack through private methods of its pipeline, so no previews; its
#   First Block Cache fails in diffusers 0.42 (the hook subtracts the dual-stream first block's output, a pair, from
#   a tensor), so TaylorSeer is its one step cache. Its edits: Flux2KleinPipeline reads 1..4 reference pictures
#   itself (``image=[...]``; VAE latents beside the noise, no strength) and, with OpenAI's mask,
#   Flux2KleinInpaintPipeline repaints the first picture under it (a strength; the others as ``image_reference``). Its
#   pipeline's own checks (``check_image_input``): sides of at least 64, an aspect of at most 8, scaled into a
#   1024x1024 area, cropped to multiples of 16; unsized, it draws at the first picture's size (the inpaint pipeline
#   always does). Four pictures: at 1024x1024 each is 4,096 image tokens, so four beside the output are 20,480 in
#   every block's joint attention, about three times a 1024x1024 text-to-image render's (docs/models.md).
QWEN_IMAGE = ModelCard(
    family="QwenImagePipeline",
    pipelines={
        "text_to_image": "QwenImagePipeline",
        "image_to_image": "QwenImageImg2ImgPipeline",
        "inpaint": "QwenImageInpaintPipeline",
    },
    prompt_embeds="padded_with_mask",
    service_decodes=True,
    latents="qwen_image",
    batches=True,
    step_caches=STEP_CACHE_METHODS,
    description="Qwen-Image (a diffusers QwenImagePipeline with its Qwen2.5-VL text encoder)",
    default_size="1328x1328",
    default_num_inference_steps=50,
    default_guidance_scale=4.0,
    default_negative_prompt=" ",
    rows=RowRecipe(),
)
Z_IMAGE = ModelCard(
    family="ZImagePipeline",
    pipelines={
        "text_to_image": "ZImagePipeline",
        "image_to_image": "ZImageImg2ImgPipeline",
        "inpaint": "ZImageInpaintPipeline",
    },
    row_width_key="cap_feat_dim",
    prompt_embeds="list_of_rows",
    latents="z_image",
    batches=True,
    cfg_above=0.0,
    description="Z-Image (a diffusers ZImagePipeline with its Qwen3 text encoder)",
    default_size="1024x1024",
    default_num_inference_steps=9,
    default_guidance_scale=0.0,
    default_negative_prompt="",
    rows=RowRecipe(
        layers=[-2],
        final_norm=False,
        template=None,
        chat_template_kwargs={"enable_thinking": True},
        drops_template=False,
        conditioning="every_row",
    ),
)
FLUX2_KLEIN = ModelCard(
    family="Flux2KleinPipeline",
    pipelines={
        "text_to_image": "Flux2KleinPipeline",
        "reference_edit": "Flux2KleinPipeline",
        "inpaint": "Flux2KleinInpaintPipeline",
    },
    reference_pictures=ReferencePictureRules(
        max_pictures=4, min_side=64, max_aspect=8, max_area=1024 * 1024, multiple=16
    ),
    prompt_embeds="rows",
    batches=False,
    step_caches=("taylorseer",),
    max_guidance_scale=1.0,
    pipeline_options=("is_distilled",),
    description="FLUX.2 [klein] (a diffusers Flux2KleinPipeline with its Qwen3 text encoder)",
    default_size="1024x1024",
    default_num_inference_steps=4,
    default_guidance_scale=1.0,
    rows=RowRecipe(
        layers=[9, 18, 27],
        final_norm=False,
        template=None,
        chat_template_kwargs={"enable_thinking": False},
        drops_template=False,
        conditioning="every_row",
    ),
)
# Qwen-Image-Edit-2511 (and 2509, the same pipeline): QwenImageEditPlusPipeline. Its model card renders in 40 steps
# with ``true_cfg_scale=4`` against ``negative_prompt=" "``, its output sized from the last picture (no size of its
# own). It reads up to three pictures in its examples, each read by the encoder at the 384x384 area and VAE-encoded
# at the 1024x1024 area, whatever the output size; the negative prompt is read with the same pictures. Rows:
# ``hidden_states[-1]`` of its edit template, the 64-token system prefix dropped. Its pipeline refuses a batch, and
# runs no text to image. Its ``encode_prompt`` keeps every row (no ``max_sequence_length`` cut), about 200 a picture
# at the 384x384 area: up to 1024 rows, its ``check_inputs``' most, so that three pictures and a prompt fit.
QWEN_IMAGE_EDIT_PLUS = ModelCard(
    family="QwenImageEditPlusPipeline",
    pipelines={"reference_edit": "QwenImageEditPlusPipeline"},
    reads_pictures=PictureReading(
        condition_area=384 * 384,
        vae_area=1024 * 1024,
        multiple=32,
        picture_prompt="Picture {}: <|vision_start|><|image_pad|><|vision_end|>",
        max_pictures=3,
    ),
    prompt_embeds="padded_with_mask",
    service_decodes=True,
    latents="qwen_image",
    batches=False,
    max_rows=1024,
    description="Qwen-Image-Edit-2511 (a diffusers QwenImageEditPlusPipeline; its Qwen2.5-VL reads the pictures)",
    default_num_inference_steps=40,
    default_guidance_scale=4.0,
    default_negative_prompt=" ",
    rows=RowRecipe(template=QWEN_IMAGE_EDIT_TEMPLATE),
)
# Qwen-Image-2.1: QwenImage21Pipeline, one model for text to image and edits, its Qwen3-VL reading the pictures. Its
# pipeline's defaults: 40 steps, ``true_cfg_scale=1`` (no CFG), 1024x1024 without pictures. Rows: ``hidden_states[-1]``
# before the final norm (the pipeline hooks the norm away, as the model was trained), its own template, only the system
# message's rows dropped. Its edits are not served: diffusers 0.42.1's ``__call__`` raises when pictures and
# ``prompt_embeds`` are both given and takes no mask of the picture rows (docs/models.md), so the AR's rows cannot
# drive them. Its VAE decodes RGBA; ardit serves opaque pictures (``dit_service.image_encoder``). Its latents unpack
# through a private method of its pipeline, so no previews; jobs do not batch (not yet shown equal to one alone).
QWEN_IMAGE_21 = ModelCard(
    family="QwenImage21Pipeline",
    pipelines={"text_to_image": "QwenImage21Pipeline"},
    row_width_key="context_in_dim",
    prompt_embeds="padded_with_mask",
    batches=False,
    pipeline_options=("sample_sigmas",),
    pipeline_needs_processor=True,
    description="Qwen-Image-2.1 (a diffusers QwenImage21Pipeline with its Qwen3-VL text encoder; text to image)",
    default_size="1024x1024",
    default_num_inference_steps=40,
    default_guidance_scale=1.0,
    default_negative_prompt=" ",
    rows=RowRecipe(final_norm=False, template=QWEN_IMAGE_21_TEMPLATE, dropped_prefix=QWEN_IMAGE_21_SYSTEM),
)
CARDS: dict[str, ModelCard] = {
    card.family: card for card in (QWEN_IMAGE, Z_IMAGE, FLUX2_KLEIN, QWEN_IMAGE_EDIT_PLUS, QWEN_IMAGE_21)
}


def ships_text_encoder(model_dir: Path) -> bool:
    """Whether a diffusers pipeline folder holds its text encoder (as published), which the AR can then serve."""
    return (model_dir / PIPELINE_INDEX).exists() and (model_dir / "text_encoder" / "config.json").exists()


def _text_encoder_layers(model_dir: Path) -> int | None:
    """How many layers the text encoder a folder ships has (a real Qwen-Image's Qwen2.5-VL: 28); None: it ships
    none. A recipe's layers are counted against it, so an AR left at the demo's layer is refused by a real
    Qwen-Image instead of feeding it rows it never saw."""
    config = _json(model_dir / "text_encoder" / "config.json")
    layers = (config.get("text_config") or {}).get("num_hidden_layers", config.get("num_hidden_layers"))
    return int(layers) if layers is not None else None


def _json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    value = json.loads(path.read_text())
    return value if isinstance(value, dict) else {}
