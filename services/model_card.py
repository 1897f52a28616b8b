"""What a model folder says about the model in it: its model card.

A folder made for ardit says it in ``ardit.json`` (the trained demo model's does). A folder as its
authors published it — a diffusers pipeline that ships its own text encoder, Qwen-Image from the hub —
gets their defaults (``PUBLISHED_CARDS``), so a user who points ardit at the download renders what the
reference renders. A folder with neither (a DiT-only folder such as the plumbing model) has an empty
card: the services' settings and fallbacks describe it.

How a model's rows are read from its text encoder (``rows``, a ``RowRecipe``: layers, final norm, template,
which rows) is its card's, else its family's published recipe, else Qwen-Image's (``hidden_states[-1]`` after the
final norm), and only where the folder ships a text encoder or the card names absolute layers: a DiT-only folder
without a card reads any layer (``rows`` None). Both services read the same card: the DiT announces it, and an AR
given the pipeline folder itself captures exactly that. Whether a text encoder is served text-only is not carried
here: the AR sees it in the checkpoint (``ar_service/engine/text_model.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from shared.diffusion import Size, StepCache
from shared.row_recipe import RowRecipe

MODEL_CARD_FILE = "ardit.json"
PIPELINE_INDEX = "model_index.json"


class ModelCard(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    description: str | None = None
    default_size: Size | None = None
    # The sizes the model draws well, decided by the judge (benchmarks/results/prompt_following_sizes);
    # no list: any size within the DiT's limits.
    sizes: list[Size] | None = None
    default_num_inference_steps: int | None = None
    # Above 1 the DiT runs classifier-free guidance (Qwen-Image's ``true_cfg_scale``) against the negative
    # prompt below, which the AR uses when a request gives none.
    default_guidance_scale: float | None = None
    default_negative_prompt: str | None = None
    # The step cache a request gets when it names none (benchmarks/results/step_cache.md decides it).
    default_step_cache: StepCache | None = None
    # torch intra-op threads the model renders fastest with on CPU, measured (benchmarks/results); None: torch's
    # default, one per core. A model whose every op is small loses more to the threads' barriers than it gains.
    cpu_threads: int | None = Field(None, ge=1)
    # How the model's rows are read from its text encoder; an ``open`` that reads them otherwise is refused.
    # None: not known (no card names it, and the checkpoint ships no text encoder to read it from).
    rows: RowRecipe | None = None

    @classmethod
    def read(cls, model_dir: Path) -> ModelCard:
        """The folder's card, its layers counted from the start; ``ValueError`` if they are not in its text encoder."""
        path = model_dir / MODEL_CARD_FILE
        card = cls.model_validate_json(path.read_text()) if path.exists() else _published_card(model_dir)
        layers = _text_encoder_layers(model_dir)
        rows = card.rows if card.rows is not None or layers is None else RowRecipe()
        if rows is None:
            return card
        if layers is None:
            if min(rows.layers) < 0:
                raise ValueError(f"{model_dir}: its card counts layers from the end, and it ships no text encoder")
            return card
        try:
            return card.model_copy(update={"rows": rows.resolved(layers)})
        except ValueError as exc:
            raise ValueError(f"{model_dir}: {exc}") from None


# The defaults the authors publish with their pipeline, by its diffusers class, and how its ``encode_prompt`` reads
# the text encoder:
# - Qwen-Image's model card and diffusers' QwenImagePipeline documentation render at 1328x1328 (its 1:1 size) in 50
#   steps with ``true_cfg_scale=4`` and ``negative_prompt=" "``. It lists other aspect ratios too, not all of them
#   multiples of 16, which diffusers would silently round down: no list, any multiple of 16 is drawn. Rows:
#   ``hidden_states[-1]``, its own template, the template's rows dropped (the recipe's defaults).
# - Z-Image-Turbo's card and diffusers' ZImagePipeline example: 1024x1024, 9 steps, ``guidance_scale=0``; with
#   guidance, CFG against ZImagePipeline's default negative prompt, "" (its ``encode_prompt``). Rows:
#   ``hidden_states[-2]`` (before the final norm) of the chat template with ``enable_thinking=True``, every
#   unpadded row kept.
# - FLUX.2 [klein]'s distilled models and diffusers' Flux2KleinPipeline example: 1024x1024, 4 steps,
#   ``guidance_scale=1``. Rows: ``hidden_states`` 9, 18 and 27 side by side, chat template with
#   ``enable_thinking=False``. diffusers pads the prompt to 512 tokens and keeps the pads' rows, computed under a
#   padding mask; a causal engine cannot compute those (each pad would attend to the prompt alone at its own
#   position), so the real rows condition it: the closer of the two to diffusers' pictures
#   (benchmarks/results/flux2_pad_rows.md).
PUBLISHED_CARDS: dict[str, ModelCard] = {
    "QwenImagePipeline": ModelCard(
        description="Qwen-Image (a diffusers QwenImagePipeline with its Qwen2.5-VL text encoder)",
        default_size="1328x1328",
        default_num_inference_steps=50,
        default_guidance_scale=4.0,
        default_negative_prompt=" ",
        rows=RowRecipe(),
    ),
    "ZImagePipeline": ModelCard(
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
            conditioning="every_row",
        ),
    ),
    "Flux2KleinPipeline": ModelCard(
        description="FLUX.2 [klein] (a diffusers Flux2KleinPipeline with its Qwen3 text encoder)",
        default_size="1024x1024",
        default_num_inference_steps=4,
        default_guidance_scale=1.0,
        rows=RowRecipe(
            layers=[9, 18, 27],
            final_norm=False,
            template=None,
            chat_template_kwargs={"enable_thinking": False},
            conditioning="every_row",
        ),
    ),
}


def _published_card(model_dir: Path) -> ModelCard:
    index = _json(model_dir / PIPELINE_INDEX)
    published = PUBLISHED_CARDS.get(str(index.get("_class_name")))
    if published is None or _json(model_dir / "text_encoder" / "config.json") == {}:
        return ModelCard()
    return published


def ships_text_encoder(model_dir: Path) -> bool:
    """Whether a diffusers pipeline folder holds its text encoder (as published), which the AR can then serve."""
    return (model_dir / PIPELINE_INDEX).exists() and (model_dir / "text_encoder" / "config.json").exists()


def _text_encoder_layers(model_dir: Path) -> int | None:
    """How many layers the text encoder a checkpoint ships has (a real Qwen-Image's Qwen2.5-VL: 28); None: it
    ships none. A recipe's layers are counted against it, so an AR left at the demo's layer is refused by a real
    Qwen-Image instead of feeding it rows it never saw."""
    config = _json(model_dir / "text_encoder" / "config.json")
    layers = (config.get("text_config") or {}).get("num_hidden_layers", config.get("num_hidden_layers"))
    return int(layers) if layers is not None else None


def _json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    value = json.loads(path.read_text())
    return value if isinstance(value, dict) else {}
