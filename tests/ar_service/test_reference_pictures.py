"""ar_service/reference_pictures.py: an edit model's pictures read at the condition size and sent at the VAE size,
each as its pipeline resizes it; an elongated picture refused before it is decoded."""

from __future__ import annotations

import io

import numpy as np
import PIL.Image
import pytest
from diffusers.image_processor import VaeImageProcessor

from ar_service.input_images import read_upload
from ar_service.reference_pictures import checked_sizes, decode_references, memory
from services.errors import ApiError
from services.model_card import QWEN_IMAGE_EDIT_PLUS, PictureReading


def reading() -> PictureReading:
    assert QWEN_IMAGE_EDIT_PLUS.reads_pictures is not None
    return QWEN_IMAGE_EDIT_PLUS.reads_pictures


READING = reading()
MAX_PIXELS = 50_000_000


def upload(width: int, height: int, seed: int = 0):
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    PIL.Image.fromarray(pixels).save(out, format="PNG")
    return read_upload(out.getvalue(), None, MAX_PIXELS)


def test_each_picture_is_read_and_sent_as_the_pipelines_own_resize_makes_it():
    uploads = [upload(448, 336, 1), upload(300, 500, 2)]
    pictures = decode_references(uploads, READING)
    resize = VaeImageProcessor(vae_scale_factor=16).resize  # what QwenImageEditPlusPipeline resizes with
    for given, read, sent in zip(uploads, pictures.read, pictures.sent, strict=True):
        original = given.image.convert("RGB")
        width, height = READING.condition_size(*original.size)
        assert np.array_equal(np.asarray(read), np.asarray(resize(original, height, width)))
        vae = resize(original, sent.height, sent.width)
        assert (sent.width, sent.height) == READING.vae_size(*original.size) == vae.size
        assert sent.data == vae.tobytes()


def test_a_picture_too_elongated_for_either_area_is_refused_naming_image():
    assert checked_sizes([upload(448, 336)], READING) == [(448, 320)]
    with pytest.raises(ApiError) as refused:
        checked_sizes([upload(448, 336), upload(8000, 4)], READING)
    assert (refused.value.param, refused.value.code) == ("image", "invalid_image_size")
    assert "picture 2 is 8000x4" in refused.value.message


def test_the_memory_held_grows_with_each_picture():
    one, two = memory([upload(448, 336)], READING), memory([upload(448, 336), upload(448, 336)], READING)
    assert one > 1184 * 896 * 3 and two == 2 * one
