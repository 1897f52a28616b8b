"""The AR's text model: where its weights and tokenizer are, its shape, and how vLLM serves it.

``ARDIT_AR_MODEL_DIR`` is either a language model's own folder (config, weights and tokenizer in one
place, as SmolLM2's) or a diffusers pipeline folder that ships its text encoder — Qwen-Image as
published, ``text_encoder/`` and ``tokenizer/`` beside the DiT's parts — read in place, so the AR and
the DiT can be given the same folder.

A text encoder vLLM cannot serve as published (a multimodal one, a config with a ``vision_config``; a bare
decoder such as Z-Image's ``Qwen3Model``) is served text-only, by its text tower (``text_towers``), unless its
family reads the user's pictures (its card's ``reads_pictures``): then vLLM serves it as published, vision tower and
all, from a folder that holds the text encoder beside the pipeline's ``processor/`` files (``vision_folder``), since
vLLM reads a model's processor from the model's own folder.
Everything a start needs is checked here, before vLLM runs, so that a folder that cannot serve fails in one
line that names what is missing (``TextModelError``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ar_service.engine.text_towers import TEXT_TOWERS, text_only_overrides
from services.model_card import PIPELINE_INDEX, ModelCard, PictureReading
from shared.row_recipe import RowRecipe

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
# Where a processor's image-processor settings are: as published (transformers 4), as transformers 5 saves them.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


class TextModelError(ValueError):
    """The AR's model folder cannot be served; the message names what is missing, in one line."""


@dataclass(frozen=True)
class TextModel:
    weights_dir: Path
    tokenizer_dir: Path
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    # The architecture vLLM serves the checkpoint's language model as; None: served as it is.
    text_tower: str | None
    # How the pipeline folder's model card reads rows (its DiT was trained on them); None: not a pipeline folder.
    card_rows: RowRecipe | None = None
    # How its family reads the user's pictures, and where the pipeline keeps its processor; None: text only.
    pictures: PictureReading | None = None
    processor_dir: Path | None = None

    @classmethod
    def read(cls, model_dir: Path) -> TextModel:
        if not model_dir.is_dir():
            raise TextModelError(f"AR model folder {model_dir} does not exist (ARDIT_AR_MODEL_DIR)")
        weights_dir, tokenizer_dir = model_dir, model_dir
        pipeline = (model_dir / PIPELINE_INDEX).exists()
        if pipeline:
            weights_dir, tokenizer_dir = _pipeline_text_encoder(model_dir)
        config = _json(weights_dir / "config.json", "the text model's config")
        card = _card(model_dir) if pipeline else None
        pictures = card.reads_pictures if card is not None else None
        text = config.get("text_config") or config
        architecture = (config.get("architectures") or ["?"])[0]
        tower = TEXT_TOWERS[architecture][0] if architecture in TEXT_TOWERS and pictures is None else None
        processor_dir = _processor_dir(model_dir, weights_dir) if pictures is not None else None
        if "vision_config" in config and tower is None and pictures is None:
            known = ", ".join(TEXT_TOWERS)
            raise TextModelError(
                f"{weights_dir} is multimodal ({architecture}) with no text-only tower here (known: {known})"
            )
        if not any(weights_dir.glob("*.safetensors")):
            raise TextModelError(f"{weights_dir} has no *.safetensors weights")
        if not any((tokenizer_dir / name).exists() for name in TOKENIZER_FILES):
            raise TextModelError(f"{tokenizer_dir} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
        for key in ("hidden_size", "num_hidden_layers"):
            if not isinstance(text.get(key), int):
                raise TextModelError(f"{weights_dir}/config.json gives no {key}")
        shape = text["hidden_size"], text["num_hidden_layers"]
        rows = card.rows if card is not None else None
        return cls(weights_dir, tokenizer_dir, architecture, *shape, tower, rows, pictures, processor_dir)

    def engine_args(self, served_dir: Path | None = None) -> dict[str, Any]:
        """vLLM engine arguments that say which model to serve and how. The AR tokenizes prompts itself
        (``PromptBuilder``) and reads only token ids back, so vLLM loads no tokenizer: it would load it in two
        processes to detokenize text nobody reads, and in a pipeline folder, whose ``tokenizer/`` has no model
        config, it retries reading one there and logs each try as an error. Generation still stops at the
        end-of-sequence ids of the model's ``generation_config.json``.

        A family that reads pictures is the exception: vLLM's multimodal processor runs in the engine (it expands
        each picture's placeholder and prepares its pixels) and needs the tokenizer; it is served from
        ``served_dir`` (``vision_folder``), the most pictures a prompt holds its card's, and no video."""
        if self.pictures is None:
            args: dict[str, Any] = {"model": str(self.weights_dir), "skip_tokenizer_init": True}
            if self.text_tower is not None:
                args["hf_overrides"] = text_only_overrides
            return args
        side = self.pictures.condition_side
        return {
            "model": str(served_dir),
            "skip_tokenizer_init": False,
            "limit_mm_per_prompt": {
                "image": {"count": self.pictures.max_pictures, "width": side, "height": side},
                "video": 0,
            },
        }


def _card(model_dir: Path) -> ModelCard:
    try:
        return ModelCard.read(model_dir)
    except ValueError as exc:
        raise TextModelError(f"the model card: {exc}") from None


def _processor_dir(model_dir: Path, weights_dir: Path) -> Path:
    processor = model_dir / "processor"
    if not any((processor / name).exists() for name in PROCESSOR_FILES):
        raise TextModelError(
            f"{model_dir}'s family reads pictures and it has no processor/ with {' or '.join(PROCESSOR_FILES)} (the "
            "pipeline's processor, which reads them)"
        )
    if clashes := sorted({p.name for p in processor.iterdir()} & {p.name for p in weights_dir.iterdir()}):
        raise TextModelError(f"{processor} and {weights_dir} both hold {clashes}: vLLM reads them from one folder")
    return processor


def _pipeline_text_encoder(model_dir: Path) -> tuple[Path, Path]:
    index = _json(model_dir / PIPELINE_INDEX, "the pipeline's index")
    parts: list[Path] = []
    # A pipeline that tokenizes with its processor (Qwen-Image-2.1's) keeps the tokenizer's files there.
    tokenizer = "tokenizer" if "tokenizer" in index or "processor" not in index else "processor"
    for part in ("text_encoder", tokenizer):
        if (index.get(part) or [None])[0] is None or not (model_dir / part).is_dir():
            raise TextModelError(
                f"{model_dir} is a {index.get('_class_name', 'diffusers')} folder without its {part}/: the AR "
                "serves the text encoder (point ARDIT_AR_MODEL_DIR at a folder that ships it)"
            )
        parts.append(model_dir / part)
    return parts[0], parts[1]


def _json(path: Path, what: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise TextModelError(f"{path} is missing ({what})") from None
    except ValueError as exc:
        raise TextModelError(f"{path} is not valid JSON ({what}): {exc}") from None
    if not isinstance(value, dict):
        raise TextModelError(f"{path} is not a JSON object ({what})")
    return value
