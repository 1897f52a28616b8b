"""The classes a model card names (``services.model_card``), as this DiT runs them.

A card names its pipelines by class name, as ``model_index.json`` does, and diffusers' own loader finds them by that
name in ``diffusers``; the latents a family's service decodes are decoded by the codec of their layout.
"""

from __future__ import annotations

from typing import Any

import diffusers

from dit_service.vae_codec import VaeCodec
from dit_service.z_image_latents import ZImageLatents
from services.model_card import LatentLayout

LatentDecoder = VaeCodec | ZImageLatents
LATENT_DECODERS: dict[LatentLayout, type[LatentDecoder]] = {"qwen_image": VaeCodec, "z_image": ZImageLatents}


def pipeline_class(name: str) -> type[Any]:
    """diffusers' pipeline class of that name (``Any``: diffusers registers a pipeline's components at run time, so a
    type checker knows none of them); ``ValueError`` for a name diffusers does not have."""
    found = getattr(diffusers, name, None)
    if not isinstance(found, type):
        raise ValueError(f"diffusers {diffusers.__version__} has no pipeline {name!r}")
    return found
