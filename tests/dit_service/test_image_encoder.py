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


@pytest.mark.parametrize("output_format", ["jpeg", "webp"])
def test_lower_output_compression_means_a_smaller_file(output_format):
    encoder = ImageEncoder()
    assert len(encoder.encode(NOISE, output_format, 20)) < len(encoder.encode(NOISE, output_format, 90))


def test_supported_formats():
    assert {"png", "jpeg"} <= set(ImageEncoder.supported()) <= {"png", "jpeg", "webp"}
