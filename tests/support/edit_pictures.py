"""The pictures and masks the edit reference tests send: smooth seeded colour fields, and OpenAI's masks of a
rectangle (transparent where the picture is to be repainted)."""

from __future__ import annotations

import io

import numpy as np
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
