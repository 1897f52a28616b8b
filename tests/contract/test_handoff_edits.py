"""The contract's image edits: ``open.edit`` and the ``pixels`` frames it announces, golden bytes,
round trips, and every rejection with its typed error (nothing stays allocated after one)."""

from __future__ import annotations

import msgpack
import pytest
import torch

from shared import errors
from shared.checksum import payload_checksum
from shared.frame_codec import decode_frame, encode_pixels
from shared.frames import SCHEMA_VERSION, EditSpec
from shared.handoff_assembler import AssemblyCaps, HandoffReceiver
from shared.handoff_encoder import HandoffEncoder
from tests.contract.conftest import join, make_open, raw
from tests.contract.golden_frames import (
    EDIT_HEIGHT,
    EDIT_WIDTH,
    golden_bytes,
    golden_edit_pixels,
    golden_path,
    golden_rows,
)

HEIGHT, WIDTH = 64, 64  # make_open's diffusion size


def edit_open(mask: bool = True):
    return make_open().model_copy(update={"edit": EditSpec(strength=0.5, mask=mask)})


def image_bytes() -> bytes:
    return bytes(range(256)) * (HEIGHT * WIDTH * 3 // 256)


def mask_bytes() -> bytes:
    return bytes([0, 255]) * (HEIGHT * WIDTH // 2)


def rows_of(enc: HandoffEncoder) -> list:
    rows = golden_rows(torch.bfloat16, 7).repeat(1, 2)  # hidden 8, as make_open
    return enc.rows("cond", 0, list(range(7)), rows)


def close_of(enc: HandoffEncoder) -> list:
    return enc.close({"cond": list(range(8))}, {"cond": 6}, 0, 6)


def rows_and_close(enc: HandoffEncoder) -> list:
    return rows_of(enc) + close_of(enc)


def receive(data: bytes, chunk: int = 1 << 20, **kwargs):
    receiver = HandoffReceiver(**kwargs)
    for i in range(0, len(data), chunk):
        receiver.feed(data[i : i + chunk])
    return receiver.finish()


def expect(error: type[errors.HandoffError], data: bytes, **kwargs) -> None:
    receiver = HandoffReceiver(**kwargs)
    with pytest.raises(error):
        receiver.feed(data)
        receiver.finish()
    assert receiver.assembler.allocated_bytes == 0


def pixels_header(role: str, shape: list[int], data: bytes, request_id: str = "req_test") -> bytes:
    return raw(
        {
            "v": SCHEMA_VERSION,
            "kind": "pixels",
            "request_id": request_id,
            "role": role,
            "shape": shape,
            "checksum": payload_checksum(data),
            "data": data,
        }
    )


def test_encoder_reproduces_the_edit_golden():
    assert golden_bytes(None) == golden_path(None).read_bytes()


def test_the_edit_golden_decodes_with_generic_msgpack():
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(golden_path(None).read_bytes())
    frames = list(unpacker)
    assert [f["kind"] for f in frames] == ["open", "pixels", "pixels", "rows", "close"]
    assert frames[0]["edit"] == {"strength": 0.5, "mask": True}
    image, mask = golden_edit_pixels()
    assert frames[1]["role"] == "image" and frames[1]["shape"] == [EDIT_HEIGHT, EDIT_WIDTH, 3]
    assert frames[1]["data"] == image and frames[1]["checksum"] == payload_checksum(image)
    assert frames[2]["role"] == "mask" and frames[2]["data"] == mask


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_the_edit_golden_assembles_at_any_chunking(chunk):
    handoff = receive(golden_path(None).read_bytes(), chunk=chunk)
    image, mask = golden_edit_pixels()
    assert handoff.edit is not None and handoff.edit.strength == 0.5
    assert bytes(handoff.edit.image.numpy().tobytes()) == image
    assert handoff.edit.image.shape == (EDIT_HEIGHT, EDIT_WIDTH, 3)
    assert handoff.edit.mask is not None and bytes(handoff.edit.mask.numpy().tobytes()) == mask


def test_pixels_may_come_after_rows_and_without_a_mask():
    enc = HandoffEncoder(edit_open(mask=False))
    wire = join(enc.open_frame() + rows_of(enc) + enc.pixels("image", image_bytes()) + close_of(enc))
    handoff = receive(wire)
    assert handoff.edit.mask is None and bytes(handoff.edit.image.numpy().tobytes()) == image_bytes()


def test_a_text_to_image_handoff_has_no_edit():
    enc = HandoffEncoder(make_open())
    assert receive(join(enc.open_frame() + rows_and_close(enc))).edit is None


def test_plain_decode_path_reads_pixels():
    frame, wire = encode_pixels("r", "mask", 2, 3, b"\x00\xff" * 3)
    decoded = decode_frame(join(wire))
    assert decoded.frame == frame and decoded.pixels == b"\x00\xff" * 3


def test_the_encoder_sends_only_announced_pixels():
    with pytest.raises(ValueError):
        HandoffEncoder(make_open()).pixels("image", image_bytes())
    with pytest.raises(ValueError):
        HandoffEncoder(edit_open(mask=False)).pixels("mask", mask_bytes())
    with pytest.raises(ValueError):
        HandoffEncoder(edit_open()).pixels("image", b"too short")


def test_reject_pixels_without_an_edit():
    enc = HandoffEncoder(make_open())
    expect(errors.FrameOutOfOrder, join(enc.open_frame()) + pixels_header("image", [HEIGHT, WIDTH, 3], image_bytes()))


def test_reject_a_mask_the_open_did_not_announce():
    enc = HandoffEncoder(edit_open(mask=False))
    expect(errors.FrameOutOfOrder, join(enc.open_frame()) + pixels_header("mask", [HEIGHT, WIDTH, 1], mask_bytes()))


def test_reject_a_second_image():
    enc = HandoffEncoder(edit_open())
    image = join(enc.pixels("image", image_bytes()))
    expect(errors.FrameOutOfOrder, join(enc.open_frame()) + image + image)


def test_reject_pixels_of_another_size():
    enc = HandoffEncoder(edit_open())
    small = bytes(32 * 32 * 3)
    expect(errors.ShapeMismatch, join(enc.open_frame()) + pixels_header("image", [32, 32, 3], small))


def test_reject_a_channel_count_that_is_not_the_roles():
    enc = HandoffEncoder(edit_open())
    four = bytes(HEIGHT * WIDTH * 4)
    expect(errors.ShapeMismatch, join(enc.open_frame()) + pixels_header("image", [HEIGHT, WIDTH, 4], four))


def test_reject_a_payload_that_does_not_fill_the_shape():
    enc = HandoffEncoder(edit_open())
    expect(errors.ShapeMismatch, join(enc.open_frame()) + pixels_header("mask", [HEIGHT, WIDTH, 1], b"\0" * 10))


def test_reject_corrupt_pixels():
    enc = HandoffEncoder(edit_open())
    wire = bytearray(join(enc.open_frame() + enc.pixels("image", image_bytes())))
    wire[-1] ^= 0x01
    expect(errors.ChecksumMismatch, bytes(wire))


def test_reject_close_before_the_mask():
    enc = HandoffEncoder(edit_open())
    expect(errors.MissingPixels, join(enc.open_frame() + enc.pixels("image", image_bytes()) + rows_and_close(enc)))


def test_reject_pixels_after_close():
    enc = HandoffEncoder(edit_open(mask=False))
    wire = join(enc.open_frame() + enc.pixels("image", image_bytes()) + rows_and_close(enc))
    expect(errors.FrameAfterClose, wire + join(enc.pixels("image", image_bytes())))


def test_an_edit_over_the_pixel_cap_allocates_nothing():
    enc = HandoffEncoder(edit_open())
    expect(errors.AllocationTooLarge, join(enc.open_frame()), caps=AssemblyCaps(max_image_pixels=HEIGHT * WIDTH - 1))


def test_pixels_count_against_the_byte_cap():
    enc = HandoffEncoder(edit_open())
    rows_bytes = 10 * 8 * 2  # make_open: 10 rows of 8 bfloat16
    just_rows = AssemblyCaps(max_bytes=rows_bytes + HEIGHT * WIDTH * 4 - 1)
    expect(errors.AllocationTooLarge, join(enc.open_frame()), caps=just_rows)
    enough = AssemblyCaps(max_bytes=rows_bytes + HEIGHT * WIDTH * 4)
    receiver = HandoffReceiver(caps=enough)
    receiver.feed(join(enc.open_frame()))
    assert receiver.assembler.allocated_bytes == rows_bytes + HEIGHT * WIDTH * 4


def test_a_strength_outside_zero_to_one_is_malformed():
    for strength in (-0.1, 1.5, float("nan")):
        frame = make_open().model_dump() | {"edit": {"strength": strength, "mask": False}}
        expect(errors.MalformedFrame, raw(frame))
