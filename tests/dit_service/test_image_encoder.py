from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from dit_service.image_encoder import ImageEncoder

NOISE = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 24, 3), dtype=np.uint8))


@pytest.mark.parametrize("output_format, pil_format", [("png", "PNG"), ("jpeg", "JPEG"), ("webp", "WEBP")])
def test_encodes_a_decodable_file_of_the_same_size(output_format, pil_format):
    decoded = Image.open(io.BytesIO(ImageEncoder().encode(NOISE, output_format, None)))
    assert decoded.format == pil_format and decoded.size == (24, 40)


def test_png_is_lossless_and_deterministic():
    data = ImageEncoder().encode(NOISE, "png", None)
    assert data == ImageEncoder().encode(NOISE, "png", 10)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(data))), np.asarray(NOISE))


@pytest.mark.parametrize("output_format", ["png", "jpeg", "webp"])
def test_a_picture_drawn_with_alpha_is_served_over_white_in_every_format(output_format):
    """Qwen-Image-2.1's VAE decodes RGBA; ardit serves opaque pictures: transparent pixels white, opaque ones kept,
    half-transparent ones blended with white."""
    blocks = {(0, 0): (200, 10, 10, 255), (0, 1): (0, 0, 200, 128), (1, 0): (0, 0, 0, 0), (1, 1): (30, 200, 30, 255)}
    served = {(0, 0): (200, 10, 10), (0, 1): (127, 127, 227), (1, 0): (255, 255, 255), (1, 1): (30, 200, 30)}
    rgba = np.zeros((32, 32, 4), dtype=np.uint8)
    for (row, column), value in blocks.items():
        rgba[row * 16 : row * 16 + 16, column * 16 : column * 16 + 16] = value
    decoded = Image.open(io.BytesIO(ImageEncoder().encode(Image.fromarray(rgba, "RGBA"), output_format, 100)))
    assert decoded.mode == "RGB"
    pixels = np.asarray(decoded).astype(int)
    tolerance = 0 if output_format == "png" else 8  # lossy formats round even at quality 100
    for (row, column), rgb in served.items():
        centre = pixels[row * 16 + 8, column * 16 + 8]
        assert np.abs(centre - np.array(rgb)).max() <= tolerance, (row, column, centre)


@pytest.mark.parametrize("output_format", ["jpeg", "webp"])
def test_lower_output_compression_means_a_smaller_file(output_format):
    encoder = ImageEncoder()
    assert len(encoder.encode(NOISE, output_format, 20)) < len(encoder.encode(NOISE, output_format, 90))


def test_supported_formats():
    assert {"png", "jpeg"} <= set(ImageEncoder.supported()) <= {"png", "jpeg", "webp"}
