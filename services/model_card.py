"""What a model folder says about the model in it: its model card.

A folder made for ardit says it in ``ardit.json`` (the trained demo model's does). A folder as its
authors published it — a diffusers pipeline that ships its own text encoder, Qwen-Image from the hub —
gets their defaults (``PUBLISHED_CARDS``), so a user who points ardit at the download renders what the
reference renders. A folder with neither (a DiT-only folder such as the plumbing model) has an empty
card: the services' settings and fallbacks describe it.

The layer a model was trained on is its card's, else its text encoder's last: diffusers' pipelines
condition on ``hidden_states[-1]``. Both services read the same card: the DiT announces it, and an AR
given the pipeline folder itself captures that layer. Whether a text encoder is served text-only is not
carried here: the AR sees it in the checkpoint (``ar_service/engine/text_model.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from shared.diffusion import Size, StepCache

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
    # The AR layer the model was trained on (the AR's ``hidden_layer``); an ``open`` from another is refused.
    # None: not known (no card names it, and the checkpoint ships no text encoder to read it from).
    hidden_layer: int | None = Field(None, ge=0)

    @classmethod
    def read(cls, model_dir: Path) -> ModelCard:
        path = model_dir / MODEL_CARD_FILE
        card = cls.model_validate_json(path.read_text()) if path.exists() else _published_card(model_dir)
        if card.hidden_layer is None:
            card = card.model_copy(update={"hidden_layer": _text_encoder_last_layer(model_dir)})
        return card


# The defaults the authors publish with their pipeline, by its diffusers class: Qwen-Image's model card and
# diffusers' QwenImagePipeline documentation render at 1328x1328 (its 1:1 size) in 50 steps with
# ``true_cfg_scale=4`` and ``negative_prompt=" "``. It lists other aspect ratios too, not all of them
# multiples of 16, which diffusers would silently round down: no list, any multiple of 16 is drawn.
PUBLISHED_CARDS: dict[str, ModelCard] = {
    "QwenImagePipeline": ModelCard(
        description="Qwen-Image (a diffusers QwenImagePipeline with its Qwen2.5-VL text encoder)",
        default_size="1328x1328",
        default_num_inference_steps=50,
        default_guidance_scale=4.0,
        default_negative_prompt=" ",
    ),
}


def _published_card(model_dir: Path) -> ModelCard:
    index = _json(model_dir / PIPELINE_INDEX)
    published = PUBLISHED_CARDS.get(str(index.get("_class_name")))
    if published is None or _json(model_dir / "text_encoder" / "config.json") == {}:
        return ModelCard()
    return published


def _text_encoder_last_layer(model_dir: Path) -> int | None:
    """The last layer of the text encoder a checkpoint ships (a real Qwen-Image's Qwen2.5-VL: 28), which
    is the layer it was trained on: QwenImagePipeline conditions on ``hidden_states[-1]``. So an AR left at
    the demo's layer is refused by a real Qwen-Image instead of feeding it rows it never saw."""
    config = _json(model_dir / "text_encoder" / "config.json")
    layers = (config.get("text_config") or {}).get("num_hidden_layers", config.get("num_hidden_layers"))
    return int(layers) if layers is not None else None


def _json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    value = json.loads(path.read_text())
    return value if isinstance(value, dict) else {}
