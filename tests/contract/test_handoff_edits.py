"""The contract's image edits: ``open.edit`` and the ``pixels`` frames it announces (each picture at its own size,
in order, then the mask), golden bytes, round trips, and every rejection with its typed error (nothing stays
allocated after one)."""

from __future__ import annotations

import msgpack
import pytest
import torch

from shared import errors
from shared.checksum import payload_checksum
from shared.frame_codec import decode_frame, encode_pixels
from shared.frames import SCHEMA_VERSION, AnnouncedPixels, EditSpec, PictureSpec
from shared.handoff_assembler import AssemblyCaps, HandoffReceiver
from shared.handoff_encoder import HandoffEncoder
from tests.contract.conftest import join, make_open, raw
from tests.contract.golden_frames import (
    EDIT_HEIGHT,
    EDIT_WIDTH,
    REFERENCE_SIZES,
    golden_bytes,
    golden_edit_pixels,
    golden_path,
    golden_picture,
    golden_rows,
)

HEIGHT, WIDTH = 64, 64  # make_open's diffusion size: an img2img edit's picture
# A reference edit's pictures, (width, height): each at its own size.
SIZES = ((48, 32), (16, 40), (32, 32))


def edit_open(mask: bool = True, strength: float | None = 0.5, sizes: tuple[tuple[int, int], ...] = ((WIDTH, HEIGHT),)):
    pictures = [PictureSpec(width=w, height=h) for w, h in sizes]
    return make_open().model_copy(update={"edit": EditSpec(pictures=pictures, strength=strength, mask=mask)})


def reference_open():
    return edit_open(mask=False, strength=None, sizes=SIZES)


def picture_bytes(width: int = WIDTH, height: int = HEIGHT, first: int = 0) -> bytes:
    return bytes((first + i) % 256 for i in range(width * height * 3))


def mask_bytes() -> bytes:
    return bytes([0, 255]) * (HEIGHT * WIDTH // 2)


def pictures_of(enc: HandoffEncoder) -> list:
    return [b for i, (w, h) in enumerate(SIZES) for b in enc.pixels("image", i, picture_bytes(w, h, first=i))]


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


def pixels_header(role: str, shape: list[int], data: bytes, index: int = 0, request_id: str = "req_test") -> bytes:
    return raw(
        {
            "v": SCHEMA_VERSION,
            "kind": "pixels",
            "request_id": request_id,
            "role": role,
            "index": index,
            "shape": shape,
            "checksum": payload_checksum(data),
            "data": data,
        }
    )


def test_encoder_reproduces_the_edit_goldens():
    for name in ("edit", "reference_edit"):
        assert golden_bytes(name) == golden_path(name).read_bytes()


def test_the_edit_golden_decodes_with_generic_msgpack():
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(golden_path("edit").read_bytes())
    frames = list(unpacker)
    assert [f["kind"] for f in frames] == ["open", "pixels", "pixels", "rows", "close"]
    assert frames[0]["edit"] == {
        "pictures": [{"width": EDIT_WIDTH, "height": EDIT_HEIGHT}],
        "strength": 0.5,
        "mask": True,
    }
    picture, mask = golden_edit_pixels()
    assert (frames[1]["role"], frames[1]["index"], frames[1]["shape"]) == ("image", 0, [EDIT_HEIGHT, EDIT_WIDTH, 3])
    assert frames[1]["data"] == picture and frames[1]["checksum"] == payload_checksum(picture)
    assert (frames[2]["role"], frames[2]["index"], frames[2]["data"]) == ("mask", 0, mask)


def test_the_reference_edit_golden_carries_each_picture_at_its_own_size_and_no_strength():
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(golden_path("reference_edit").read_bytes())
    frames = list(unpacker)
    assert [f["kind"] for f in frames] == ["open", "pixels", "pixels", "rows", "close"]
    assert frames[0]["edit"] == {"pictures": [{"width": w, "height": h} for w, h in REFERENCE_SIZES], "mask": False}
    for index, (width, height) in enumerate(REFERENCE_SIZES):
        frame = frames[1 + index]
        assert (frame["role"], frame["index"], frame["shape"]) == ("image", index, [height, width, 3])
        assert frame["data"] == golden_picture(width, height, step=index + 5)


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_the_edit_golden_assembles_at_any_chunking(chunk):
    handoff = receive(golden_path("edit").read_bytes(), chunk=chunk)
    picture, mask = golden_edit_pixels()
    assert handoff.edit is not None and handoff.edit.strength == 0.5
    [assembled] = handoff.edit.pictures
    assert bytes(assembled.numpy().tobytes()) == picture and assembled.shape == (EDIT_HEIGHT, EDIT_WIDTH, 3)
    assert handoff.edit.mask is not None and bytes(handoff.edit.mask.numpy().tobytes()) == mask


def test_the_reference_edit_golden_assembles_its_pictures_in_order():
    handoff = receive(golden_path("reference_edit").read_bytes(), chunk=3)
    assert handoff.edit is not None and handoff.edit.strength is None and handoff.edit.mask is None
    assert [tuple(p.shape) for p in handoff.edit.pictures] == [(h, w, 3) for w, h in REFERENCE_SIZES]


def test_pictures_of_their_own_sizes_arrive_in_order_after_the_rows_too():
    enc = HandoffEncoder(reference_open())
    handoff = receive(join(enc.open_frame() + rows_of(enc) + pictures_of(enc) + close_of(enc)))
    assert handoff.edit is not None
    for index, ((width, height), picture) in enumerate(zip(SIZES, handoff.edit.pictures, strict=True)):
        assert bytes(picture.numpy().tobytes()) == picture_bytes(width, height, first=index)


def test_an_edit_announces_one_frame_per_picture_in_order_then_the_mask_the_first_pictures_size():
    edit = EditSpec(pictures=[PictureSpec(width=4, height=2), PictureSpec(width=3, height=5)], mask=True)
    assert edit.announced == (
        AnnouncedPixels("image", 0, (2, 4, 3)),
        AnnouncedPixels("image", 1, (5, 3, 3)),
        AnnouncedPixels("mask", 0, (2, 4, 1)),
    )
    assert edit.pixels == 4 * 2 + 3 * 5


def test_a_text_to_image_handoff_has_no_edit():
    enc = HandoffEncoder(make_open())
    assert receive(join(enc.open_frame() + rows_and_close(enc))).edit is None


def test_plain_decode_path_reads_pixels():
    frame, wire = encode_pixels("r", AnnouncedPixels("mask", 0, (2, 3, 1)), b"\x00\xff" * 3)
    decoded = decode_frame(join(wire))
    assert decoded.frame == frame and decoded.pixels == b"\x00\xff" * 3


def test_the_encoder_sends_only_announced_pixels():
    with pytest.raises(ValueError):
        HandoffEncoder(make_open()).pixels("image", 0, picture_bytes())
    with pytest.raises(ValueError):
        HandoffEncoder(edit_open(mask=False)).pixels("mask", 0, mask_bytes())
    with pytest.raises(ValueError):
        HandoffEncoder(edit_open()).pixels("image", 1, picture_bytes())
    with pytest.raises(ValueError):
        HandoffEncoder(edit_open()).pixels("image", 0, b"too short")


@pytest.mark.parametrize(
    "edit",
    [
        {"pictures": [], "mask": False},
        {"pictures": [{"width": 4, "height": 4}] * 17, "mask": False},
        {"pictures": [{"width": 0, "height": 4}], "mask": False},
    ],
    ids=["no-picture", "seventeen-pictures", "a-zero-side"],
)
def test_an_edit_of_no_picture_more_than_sixteen_or_an_empty_one_is_malformed(edit):
    expect(errors.MalformedFrame, raw(make_open().model_dump() | {"edit": edit}))


def test_reject_pixels_without_an_edit():
    enc = HandoffEncoder(make_open())
    expect(errors.FrameOutOfOrder, join(enc.open_frame()) + pixels_header("image", [HEIGHT, WIDTH, 3], picture_bytes()))


def test_reject_a_mask_the_open_did_not_announce():
    enc = HandoffEncoder(edit_open(mask=False))
    image = join(enc.pixels("image", 0, picture_bytes()))
    expect(
        errors.FrameOutOfOrder, join(enc.open_frame()) + image + pixels_header("mask", [HEIGHT, WIDTH, 1], mask_bytes())
    )


def test_reject_a_second_picture_0():
    enc = HandoffEncoder(edit_open())
    image = join(enc.pixels("image", 0, picture_bytes()))
    expect(errors.FrameOutOfOrder, join(enc.open_frame()) + image + image)


def test_reject_pictures_out_of_order():
    enc = HandoffEncoder(reference_open())
    second = join(enc.pixels("image", 1, picture_bytes(*SIZES[1], first=1)))
    expect(errors.FrameOutOfOrder, join(enc.open_frame()) + second)


def test_reject_the_mask_before_the_picture():
    enc = HandoffEncoder(edit_open())
    expect(errors.FrameOutOfOrder, join(enc.open_frame() + enc.pixels("mask", 0, mask_bytes())))


def test_reject_a_picture_at_another_size_than_announced():
    enc = HandoffEncoder(reference_open())
    width, height = SIZES[0]
    swapped = pixels_header("image", [width, height, 3], picture_bytes(width, height))
    expect(errors.ShapeMismatch, join(enc.open_frame()) + swapped)


def test_reject_a_channel_count_that_is_not_the_roles():
    enc = HandoffEncoder(edit_open())
    four = bytes(HEIGHT * WIDTH * 4)
    expect(errors.ShapeMismatch, join(enc.open_frame()) + pixels_header("image", [HEIGHT, WIDTH, 4], four))


def test_reject_a_payload_that_does_not_fill_the_shape():
    enc = HandoffEncoder(edit_open())
    image = join(enc.pixels("image", 0, picture_bytes()))
    expect(errors.ShapeMismatch, join(enc.open_frame()) + image + pixels_header("mask", [HEIGHT, WIDTH, 1], b"\0" * 10))


def test_reject_corrupt_pixels():
    enc = HandoffEncoder(edit_open())
    wire = bytearray(join(enc.open_frame() + enc.pixels("image", 0, picture_bytes())))
    wire[-1] ^= 0x01
    expect(errors.ChecksumMismatch, bytes(wire))


def test_reject_close_before_the_mask():
    enc = HandoffEncoder(edit_open())
    wire = join(enc.open_frame() + enc.pixels("image", 0, picture_bytes()) + rows_and_close(enc))
    expect(errors.MissingPixels, wire)


def test_reject_close_before_the_last_picture():
    enc = HandoffEncoder(reference_open())
    expect(errors.MissingPixels, join(enc.open_frame() + pictures_of(enc)[:4] + rows_and_close(enc)))


def test_reject_pixels_after_close():
    enc = HandoffEncoder(edit_open(mask=False))
    wire = join(enc.open_frame() + enc.pixels("image", 0, picture_bytes()) + rows_and_close(enc))
    expect(errors.FrameAfterClose, wire + join(enc.pixels("image", 0, picture_bytes())))


def test_a_picture_over_the_per_picture_cap_allocates_nothing():
    enc = HandoffEncoder(reference_open())
    largest = max(w * h for w, h in SIZES)
    expect(errors.AllocationTooLarge, join(enc.open_frame()), caps=AssemblyCaps(max_image_pixels=largest - 1))
    receiver = HandoffReceiver(caps=AssemblyCaps(max_image_pixels=largest))
    receiver.feed(join(enc.open_frame()))
    assert receiver.assembler.allocated_bytes > 0


def test_pictures_over_the_per_edit_cap_together_allocate_nothing():
    enc = HandoffEncoder(reference_open())
    total = sum(w * h for w, h in SIZES)
    expect(errors.AllocationTooLarge, join(enc.open_frame()), caps=AssemblyCaps(max_edit_pixels=total - 1))
    receiver = HandoffReceiver(caps=AssemblyCaps(max_edit_pixels=total))
    receiver.feed(join(enc.open_frame()))
    assert receiver.assembler.allocated_bytes > 0


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
        frame = make_open().model_dump() | {"edit": {"pictures": [{"width": 64, "height": 64}], "strength": strength}}
        expect(errors.MalformedFrame, raw(frame))


def test_the_receivers_check_of_open_refuses_before_anything_is_allocated_or_a_pixel_read():
    def refuse(frame):
        raise errors.InvalidDiffusionParams("no edits here", param="image")

    enc = HandoffEncoder(edit_open())
    receiver = HandoffReceiver(check_open=refuse)
    with pytest.raises(errors.InvalidDiffusionParams):
        receiver.feed(join(enc.open_frame() + enc.pixels("image", 0, picture_bytes())))
    assert receiver.assembler.open is None and receiver.assembler.allocated_bytes == 0
    assert receiver.reader.frames == 1  # the open frame; the picture after it was never read
