"""The diffusers families this DiT renders, and which of ardit's features each runs: one home for per-family facts.

A model folder's family is its pipeline's class, as its ``model_index.json`` names it (``_class_name``, what
diffusers itself loads). Every family renders through its own diffusers pipeline, given the rows as its
``prompt_embeds``, so a picture is diffusers' own for those rows by construction.

Qwen-Image runs every feature. Z-Image and FLUX.2 [klein] run text to image only:

- previews: a preview is a latent the step callback estimates mid-run, which the service decodes as the family's
  pipeline would (``decoder``): Qwen-Image's packed latents (``VaeCodec``), Z-Image's (``ZImageLatents``, four
  public lines of its ``__call__``). FLUX.2's latents unpack through private methods of its pipeline: no previews.
- edits: the service encodes an edit's image and decodes its picture itself (``VaeCodec``), Qwen-Image's only;
  the other two pipelines decode their own pictures.
- batching: FLUX.2's transformer takes no mask over the rows, so jobs whose rows differ in length cannot share a
  run. ZImagePipeline takes each image's rows as a list and masks them itself: a batch renders each picture as
  alone but for float rounding (tests/dit_service/test_families.py).
- step caches: diffusers' cache hooks are ``CacheMixin.enable_cache``, which Z-Image's transformer does not have.
  FLUX.2's has it, and runs TaylorSeer; its First Block Cache fails in diffusers 0.42 (the hook subtracts the
  dual-stream first block's output, a pair, from a tensor: TypeError), so FLUX.2 offers TaylorSeer only.
- guidance: a family's ``guidance_scale`` means what its pipeline means by it, and CFG runs where its pipeline runs
  it, against the AR's negative rows: Qwen-Image's ``true_cfg_scale`` above 1, ZImagePipeline's above 0
  (``cfg_above``, announced). Flux2KleinPipeline runs CFG above 1 only for an undistilled model, and a distilled one
  ignores guidance (diffusers only warns): capped at 1, so more is refused, not silently ignored.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from diffusers import (
    Flux2KleinPipeline,
    QwenImageImg2ImgPipeline,
    QwenImageInpaintPipeline,
    QwenImagePipeline,
    ZImagePipeline,
)

from dit_service.vae_codec import VaeCodec
from dit_service.z_image_latents import ZImageLatents
from services.model_card import PIPELINE_INDEX
from shared.diffusion import STEP_CACHE_METHODS, StepCacheMethod

PipelineKind = Literal["text_to_image", "image_to_image", "inpaint"]
# How a family's pipeline takes the rows as ``prompt_embeds``:
# - "padded_with_mask": [B, L, D] right-padded to the longest, with ``prompt_embeds_mask`` (Qwen-Image);
# - "list_of_rows": one [L_i, D] tensor of each image's own rows (Z-Image, as its ``encode_prompt`` gives them);
# - "rows": [B, L, D] of the rows alone, no padding (FLUX.2: its transformer would attend to pad rows).
PromptEmbedsForm = Literal["padded_with_mask", "list_of_rows", "rows"]
LatentDecoder = VaeCodec | ZImageLatents


@dataclass(frozen=True)
class Family:
    # The pipeline class, as ``model_index.json`` names it.
    name: str
    # The pipeline class of each kind of render it runs: text to image always, an edit's where it edits (``Any``:
    # diffusers registers a pipeline's components at run time, so a type checker knows none of them).
    pipelines: Mapping[PipelineKind, type[Any]]
    # The transformer config field that holds the width of its conditioning rows.
    rows_width: str
    prompt_embeds: PromptEmbedsForm
    # The service decodes the pipeline's latents itself (``VaeCodec``), as edits need; else the pipeline decodes its
    # own picture.
    service_decodes: bool
    # What decodes the family's latents in the service (previews, and finals where it decodes them); None: nothing.
    decoder: type[LatentDecoder] | None
    batches: bool
    # The step-cache methods diffusers' hooks run on its transformer.
    step_caches: tuple[StepCacheMethod, ...]
    # The most guidance its pipeline renders as asked (inf: no cap beyond the operator's).
    max_guidance_scale: float = math.inf
    # Its pipeline runs classifier-free guidance at a guidance scale above this (``DiffusionParams.cfg_above``).
    cfg_above: float = 1.0
    # The loaded pipeline's own config options each request's pipeline is built with too.
    pipeline_options: tuple[str, ...] = ()

    @property
    def previews(self) -> bool:
        return self.decoder is not None

    @property
    def edits(self) -> bool:
        return self.service_decodes and "image_to_image" in self.pipelines

    @classmethod
    def of(cls, model_dir: Path) -> Family:
        """The family of the pipeline in ``model_dir``; ``ValueError`` for one this DiT does not render."""
        name = json.loads((model_dir / PIPELINE_INDEX).read_text()).get("_class_name")
        family = FAMILIES.get(str(name))
        if family is None:
            raise ValueError(f"{model_dir}: a {name} pipeline; this DiT renders {', '.join(FAMILIES)}")
        return family


QWEN_IMAGE = Family(
    name="QwenImagePipeline",
    pipelines={
        "text_to_image": QwenImagePipeline,
        "image_to_image": QwenImageImg2ImgPipeline,
        "inpaint": QwenImageInpaintPipeline,
    },
    rows_width="joint_attention_dim",
    prompt_embeds="padded_with_mask",
    service_decodes=True,
    decoder=VaeCodec,
    batches=True,
    step_caches=STEP_CACHE_METHODS,
)
Z_IMAGE = Family(
    name="ZImagePipeline",
    pipelines={"text_to_image": ZImagePipeline},
    rows_width="cap_feat_dim",
    prompt_embeds="list_of_rows",
    service_decodes=False,
    decoder=ZImageLatents,
    batches=True,
    step_caches=(),
    cfg_above=0.0,
)
FLUX2_KLEIN = Family(
    name="Flux2KleinPipeline",
    pipelines={"text_to_image": Flux2KleinPipeline},
    rows_width="joint_attention_dim",
    prompt_embeds="rows",
    service_decodes=False,
    decoder=None,
    batches=False,
    step_caches=("taylorseer",),
    max_guidance_scale=1.0,
    pipeline_options=("is_distilled",),
)
FAMILIES: dict[str, Family] = {family.name: family for family in (QWEN_IMAGE, Z_IMAGE, FLUX2_KLEIN)}
