"""Uploaded images → an edit's pixels: formats, caps before decoding, masks, orientation, sizes."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from ar_service.input_images import EditMemory, EditPixels, OutputSize, decode_edit, read_upload
from services.errors import ApiError, Overloaded

AUTO = OutputSize(requested=None, multiple=16, max_pixels=256 * 256)
CAP = 4096 * 4096


def encoded(image: Image.Image, fmt: str = "PNG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def noise(width: int = 48, height: int = 32) -> Image.Image:
    return Image.fromarray((np.random.default_rng(0).random((height, width, 3)) * 255).astype(np.uint8))


def mask_png(width: int = 48, height: int = 32, hole: tuple[int, int, int, int] = (0, 0, 16, 16)) -> bytes:
    mask = Image.new("RGBA", (width, height), (255, 255, 255, 255))
    mask.paste((0, 0, 0, 0), hole)
    return encoded(mask)


def decode(image: bytes, mask: bytes | None = None, size: OutputSize = AUTO, cap: int = CAP) -> EditPixels:
    """Both steps: the headers read and checked, then the decode."""
    return decode_edit(read_upload(image, mask, cap), size)


def refusal(image: bytes, mask: bytes | None = None, cap: int = CAP) -> ApiError:
    with pytest.raises(ApiError) as info:
        decode(image, mask, cap=cap)
    assert info.value.status == 400
    return info.value


def as_array(pixels: EditPixels) -> np.ndarray:
    [picture] = pixels.pictures
    return np.frombuffer(picture.data, np.uint8).reshape(picture.height, picture.width, 3)


def size_of(pixels: EditPixels) -> tuple[int, int]:
    """The one picture's (width, height): an edit decoded here is one picture, at the output size."""
    [picture] = pixels.pictures
    return picture.width, picture.height


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_lossless_inputs_arrive_pixel_for_pixel(fmt):
    options = {"lossless": True} if fmt == "WEBP" else {}
    pixels = decode(encoded(noise(), fmt, **options))
    assert (size_of(pixels), pixels.mask) == ((48, 32), None)
    assert np.array_equal(as_array(pixels), np.asarray(noise()))


def test_a_jpeg_is_accepted():
    assert size_of(decode(encoded(noise(), "JPEG"))) == (48, 32)


def test_size_auto_fits_the_input_to_the_pixel_limit_in_multiples():
    assert OutputSize(None, 16, 256 * 256).for_input(50, 33) == (48, 32)
    assert OutputSize(None, 16, 256 * 256).for_input(1024, 512) == (352, 176)
    assert OutputSize(None, 16, 256 * 256).for_input(5, 5) == (16, 16)
    assert OutputSize((64, 32), 16, 256 * 256).for_input(1024, 512) == (64, 32)


def test_size_auto_is_the_listed_size_nearest_the_inputs_shape_when_the_model_lists_its_sizes():
    listed = OutputSize(None, 16, 256 * 256, listed=((64, 64), (128, 64), (64, 128)))
    assert listed.for_input(1000, 990) == (64, 64)
    assert listed.for_input(300, 100) == (128, 64)  # 3:1 is nearer 2:1 than 1:1
    assert listed.for_input(100, 180) == (64, 128)
    assert OutputSize((64, 64), 16, 256 * 256, listed=((128, 64),)).for_input(300, 100) == (64, 64)


def test_a_named_size_resizes_image_and_mask_alike():
    pixels = decode(encoded(noise()), mask_png(), OutputSize((96, 64), 16, 256 * 256))
    assert size_of(pixels) == (96, 64)
    assert pixels.mask is not None
    mask = np.frombuffer(pixels.mask, np.uint8).reshape(64, 96)
    assert set(np.unique(mask)) == {0, 255}  # nearest neighbour: still a hard mask
    assert mask[:32, :32].min() == 255 and mask[32:, 32:].max() == 0


def test_the_masks_transparent_pixels_are_the_ones_repainted():
    pixels = decode(encoded(noise()), mask_png())
    assert pixels.mask is not None
    mask = np.frombuffer(pixels.mask, np.uint8).reshape(32, 48)
    assert mask[:16, :16].min() == 255 and mask[16:, :].max() == 0 and mask[:, 16:].max() == 0


def test_a_palette_mask_with_a_transparent_index_works():
    palette = Image.new("P", (48, 32), 1)
    palette.putpalette([0, 0, 0, 255, 255, 255])
    palette.paste(0, (0, 0, 16, 16))
    pixels = decode(encoded(noise()), encoded(palette, transparency=0))
    assert pixels.mask is not None
    mask = np.frombuffer(pixels.mask, np.uint8)
    assert mask.reshape(32, 48)[:16, :16].min() == 255 and mask.reshape(32, 48)[16:].max() == 0


def test_exif_orientation_is_applied():
    upright = noise(32, 48)
    rotated = upright.transpose(Image.Transpose.ROTATE_90)  # stored turned a quarter counter-clockwise ...
    exif = Image.Exif()
    exif[0x0112] = 6  # ... and tagged "turn a quarter clockwise to view"
    pixels = decode(encoded(rotated, "PNG", exif=exif))
    assert size_of(pixels) == (32, 48)
    assert np.array_equal(as_array(pixels), np.asarray(upright))


@pytest.mark.parametrize(
    "data",
    [b"", b"not an image at all", encoded(noise(), "GIF"), encoded(noise(), "BMP")],
    ids=["empty", "text", "gif", "bmp"],
)
def test_what_is_not_png_jpeg_or_webp_is_refused(data):
    error = refusal(data)
    assert (error.param, error.code) == ("image", "invalid_image_format")


def test_a_truncated_png_is_refused():
    png = encoded(noise())
    assert refusal(png[: len(png) // 2]).code == "invalid_image_format"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares ``width x height`` and carries almost no data: a decompression bomb's header."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


@pytest.mark.parametrize("side", [5000, 40_000], ids=["over our cap", "over Pillow's own"])
def test_a_decompression_bomb_is_refused_from_its_header(side):
    error = refusal(png_header_only(side, side))
    assert (error.param, error.code) == ("image", "image_too_large")


def test_the_pixel_cap_is_a_setting():
    assert refusal(encoded(noise()), cap=48 * 32 - 1).code == "image_too_large"
    assert size_of(decode(encoded(noise()), cap=48 * 32)) == (48, 32)


def test_a_mask_must_be_a_png_of_the_images_size_with_alpha():
    image = encoded(noise())
    assert (refusal(image, mask_png(32, 32)).param, refusal(image, mask_png(32, 32)).code) == (
        "mask",
        "invalid_image_size",
    )
    no_alpha = encoded(Image.new("RGB", (48, 32)))
    assert (refusal(image, no_alpha).param, refusal(image, no_alpha).code) == ("mask", "invalid_image_format")
    webp = encoded(Image.new("RGBA", (48, 32)), "WEBP")
    assert refusal(image, webp).param == "mask"
    assert refusal(image, png_header_only(9000, 9000)).param == "mask"


@settings(max_examples=300, deadline=None, derandomize=True)
@given(cut=st.integers(min_value=0), flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255))))
def test_any_damaged_upload_is_a_400_or_an_image_never_a_crash(cut, flips):
    data = bytearray(encoded(noise(), "PNG"))
    for at, value in flips:
        data[at % len(data)] = value
    data = data[: len(data) - cut % len(data)]
    try:
        pixels = decode(bytes(data))
    except ApiError as error:
        assert error.status == 400 and error.param == "image"
    else:
        [picture] = pixels.pictures
        assert len(picture.data) == picture.width * picture.height * 3


def test_edits_in_hand_are_bounded_in_bytes_and_one_byte_past_the_bound_is_a_429():
    memory = EditMemory(max_bytes=1000)
    first = memory.hold(600)
    with pytest.raises(Overloaded) as refused:
        memory.hold(401)
    assert refused.value.status == 429
    second = memory.hold(400)  # exactly the bound fits
    first.release()
    first.release()  # idempotent
    second.release()
    assert memory.held == 0


def test_an_edit_that_alone_needs_more_than_the_bound_is_a_400_not_a_retry():
    memory = EditMemory(max_bytes=1000)
    with pytest.raises(ApiError) as refused:
        memory.hold(1001)
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, "image", "image_too_large")
    assert memory.held == 0


# Run in a process of its own, so that its peak resident memory is the edit's: the peak is reset once the
# files are read, then the edit is counted, decoded and resized, and the peak read again.
_MEASURE = """
import json, sys
from pathlib import Path
from ar_service.input_images import OutputSize, decode_edit, read_upload

def kib(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field))

image, mask, width, height = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
image, mask = Path(image).read_bytes(), Path(mask).read_bytes() if mask else None
Path("/proc/self/clear_refs").write_text("5")
before = kib("VmRSS")
upload = read_upload(image, mask, 4096 * 4096)
counted = upload.memory(width, height)
decode_edit(upload, OutputSize((width, height), 16, width * height))
print(json.dumps({"counted": counted, "peak": (kib("VmHWM") - before) * 1024}))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("shape", "masked", "output"),
    [
        ((16_000_000, 1), False, (64, 64)),  # thin: Lanczos weights across the long side, without a reduction
        ((1, 4_000_000), False, (64, 64)),  # tall: a pointer per row in every copy
        ((1, 4_000_000), True, (1024, 1024)),
        ((4096, 4096), True, (1024, 1024)),  # the largest the pixel cap takes, as photos are
        ((3000, 2000), False, (64, 64)),
    ],
)
def test_an_edits_count_covers_what_decoding_and_resizing_it_really_takes(tmp_path, shape, masked, output):
    image = tmp_path / "image.png"
    image.write_bytes(encoded(Image.new("RGB", shape, (10, 200, 30))))
    mask = tmp_path / "mask.png"
    if masked:
        mask.write_bytes(encoded(Image.new("RGBA", shape, (0, 0, 0, 0))))
    measured = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(image), str(mask) if masked else "", *map(str, output)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    figures = json.loads(measured.stdout)
    assert 0 < figures["peak"] <= figures["counted"], figures
