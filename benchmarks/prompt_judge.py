"""A procedural judge of demo-model pictures: what shape, which colours, where.

It shares nothing with the model or the scene generator: its colour names are its own reference
colours (pure primaries, yellow, white, black), and it reads a picture with plain geometry:

- background: the median colour of the outer two-pixel ring;
- the shape: the largest 4-connected region of pixels far from that background colour;
- shape colour: the median colour of that region; position: the quarter of the picture its centre of mass lies in;
- shape kind: how full the four corners of the region's bounding box are: a square fills all four,
  a triangle standing on its base fills only the bottom two, a circle none.

Each colour is named by the nearest reference colour. ``prompt_following.py`` checks the judge on the
generator's own pictures before it scores any model output.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from PIL import Image

REFERENCE_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "white": (255, 255, 255),
    "black": (0, 0, 0),
}
ROWS = ("top", "bottom")
COLUMNS = ("left", "right")

BORDER = 2  # pixels of the outer ring that sample the background
FOREGROUND_DISTANCE = 80.0  # RGB distance from the background colour that makes a pixel part of a shape
CORNER_FRACTION = 0.2  # corner patch side, as a fraction of the bounding box side
CORNER_FILLED = 0.5  # a corner patch at least this full counts as filled


@dataclass(frozen=True)
class Reading:
    shape: str | None  # None: no shape found
    colour: str | None
    background: str
    row: str | None
    column: str | None


def colour_name(rgb: np.ndarray) -> str:
    names = list(REFERENCE_COLOURS)
    references = np.array([REFERENCE_COLOURS[n] for n in names], dtype=np.float64)
    return names[int(np.argmin(np.linalg.norm(references - rgb, axis=1)))]


def largest_region(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected region of ``mask`` (a boolean picture), as a boolean picture."""
    height, width = mask.shape
    labels = np.zeros(mask.shape, dtype=np.int32)
    best_label, best_size, label = 0, 0, 0
    for y0, x0 in zip(*np.nonzero(mask), strict=True):
        if labels[y0, x0]:
            continue
        label += 1
        labels[y0, x0] = label
        size, queue = 0, deque([(y0, x0)])
        while queue:
            y, x = queue.popleft()
            size += 1
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < height and 0 <= nx < width and mask[ny, nx] and not labels[ny, nx]:
                    labels[ny, nx] = label
                    queue.append((ny, nx))
        if size > best_size:
            best_label, best_size = label, size
    return labels == best_label if best_size else np.zeros_like(mask)


def shape_kind(region: np.ndarray) -> str:
    ys, xs = np.nonzero(region)
    box = region[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1]
    h, w = box.shape
    ph, pw = max(1, round(CORNER_FRACTION * h)), max(1, round(CORNER_FRACTION * w))
    top = (box[:ph, :pw].mean() + box[:ph, -pw:].mean()) / 2
    bottom = (box[-ph:, :pw].mean() + box[-ph:, -pw:].mean()) / 2
    if bottom >= CORNER_FILLED:
        return "square" if top >= CORNER_FILLED else "triangle"
    return "circle"


def judge(image: Image.Image) -> Reading:
    pixels = np.asarray(image.convert("RGB"), dtype=np.float64)
    height, width, _ = pixels.shape
    ring = np.ones((height, width), dtype=bool)
    ring[BORDER:-BORDER, BORDER:-BORDER] = False
    background_rgb = np.median(pixels[ring], axis=0)
    background = colour_name(background_rgb)
    region = largest_region(np.linalg.norm(pixels - background_rgb, axis=2) > FOREGROUND_DISTANCE)
    if not region.any():
        return Reading(None, None, background, None, None)
    ys, xs = np.nonzero(region)
    row = ROWS[min(int((ys.mean() + 0.5) * len(ROWS) / height), len(ROWS) - 1)]
    column = COLUMNS[min(int((xs.mean() + 0.5) * len(COLUMNS) / width), len(COLUMNS) - 1)]
    colour = colour_name(np.median(pixels[region], axis=0))
    return Reading(shape_kind(region), colour, background, row, column)
