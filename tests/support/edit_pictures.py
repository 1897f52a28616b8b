"""The pictures and masks the edit reference tests send: smooth seeded colour fields, and OpenAI's masks of a
rectangle (transparent where the picture is to be repainted)."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import torch
from openai import OpenAI
from PIL import Image

SIZE = 64
REPAINTED = (8, 16, 40, 48)  # x0, y0, x1, y1: where OpenAI's mask is transparent


def picture(seed: int, width: int = SIZE, height: int = SIZE) -> Image.Image:
    """Smooth seeded colour fields (a VAE keeps those; noise it would blur), one per seed."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    channels = [np.sin(2 * np.pi * (rng.uniform(0.5, 2) * x + rng.uniform(0.5, 2) * y + rng.uniform())) for _ in "rgb"]
    return Image.fromarray((np.stack(channels, -1) * 110 + 128).astype(np.uint8))


def repaint_mask(shift: int = 0, inverted: bool = False) -> np.ndarray:
    """Where diffusers repaints (True), from OpenAI's mask: its transparent pixels."""
    x0, y0, x1, y1 = REPAINTED
    inside = np.zeros((SIZE, SIZE), bool)
    inside[y0:y1, x0 + shift : x1 + shift] = True
    return ~inside if inverted else inside


def openai_mask(repaint: np.ndarray) -> bytes:
    """OpenAI's mask of ``repaint``: opaque everywhere, fully transparent where the picture is to be edited."""
    alpha = np.where(repaint, 0, 255).astype(np.uint8)
    return png(Image.fromarray(np.dstack([np.zeros((SIZE, SIZE, 3), np.uint8), alpha]), "RGBA"))


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def edited(
    client: OpenAI, images: list[Image.Image], prompt: str, mask: np.ndarray | None, size: str, extra: dict[str, Any]
) -> np.ndarray:
    """The picture the service answers an edit of ``images`` with (the official client; ``image[]`` for several),
    OpenAI's mask of ``mask`` where one is given; ``extra`` fields left out where None."""
    files: dict[str, Any] = {"mask": ("mask.png", openai_mask(mask), "image/png")} if mask is not None else {}
    result = client.images.edit(
        image=[(f"in{n}.png", png(image), "image/png") for n, image in enumerate(images)],
        prompt=prompt,
        size=size,
        extra_body={name: value for name, value in extra.items() if value is not None},
        **files,
    )
    assert result.data is not None
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json or ""))).convert("RGB"))


def loaded(folder: Path, classes: dict[str, Any]) -> dict[tuple[str, torch.dtype], Any]:
    """Each of the family's pipelines ``classes`` (by kind) in fp32 (the reference) and bf16 (their own bf16 error),
    each loaded on its own: ``from_pipe`` casts the modules it shares to its own dtype, fp32 by default."""
    pipelines = {}
    for dtype in (torch.float32, torch.bfloat16):
        for kind, pipeline_class in classes.items():
            pipeline = pipeline_class.from_pretrained(str(folder), dtype=dtype)
            pipeline.set_progress_bar_config(disable=True)
            pipelines[kind, dtype] = pipeline
    return pipelines
