"""The AR→DiT wire contract: golden bytes, round trips, and every rejection with its typed error."""

from __future__ import annotations

import struct

import msgpack
import pytest
import torch

from shared import errors
from shared.checksum import payload_checksum, stream_checksum
from shared.frame_codec import FrameLimits, decode_frame, encode_rows
from shared.frames import SCHEMA_VERSION, StreamName, frame_header
from shared.handoff_assembler import AssemblyCaps, HandoffReceiver
from shared.handoff_encoder import HandoffEncoder
from shared.row_recipe import RowRecipe
from shared.tensor_codec import tensor_bytes, token_ids_to_bytes
from tests.contract.conftest import join, make_open, raw
from tests.contract.golden_frames import HIDDEN, dtype_name, golden_bytes, golden_path, golden_rows

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def receive(data: bytes, chunk: int = 1 << 20, **kwargs):
    receiver = HandoffReceiver(**kwargs)
    for i in range(0, len(data), chunk):
        receiver.feed(data[i : i + chunk])
    return receiver.finish()


def ids(*token_ids: int) -> bytes:
    return token_ids_to_bytes(token_ids)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


# --- golden vectors ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_encoder_reproduces_golden_bytes(dtype):
    assert golden_bytes(dtype_name(dtype)) == golden_path(dtype_name(dtype)).read_bytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_golden_decodes_with_generic_msgpack(dtype):
    """No ardit code: a stock streaming msgpack decoder sees five self-describing maps."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(golden_path(dtype_name(dtype)).read_bytes())
    frames = list(unpacker)
    assert [f["kind"] for f in frames] == ["open", "rows", "rows", "rows", "close"]
    assert all(f["v"] == SCHEMA_VERSION for f in frames)
    first = frames[1]
    assert first["shape"] == [3, HIDDEN] and struct.unpack("<3I", first["token_ids"]) == (11, 12, 13)
    assert first["data"] == bytes(tensor_bytes(golden_rows(dtype, 3)))
    assert len(first["data"]) == 3 * HIDDEN * dtype.itemsize
    cond = golden_rows(dtype, 4)
    assert first["checksum"] == payload_checksum(first["data"])
    frame_sums = {0: payload_checksum(tensor_bytes(cond[:3])), 3: payload_checksum(tensor_bytes(cond[3:]))}
    assert frames[4]["streams"]["cond"]["checksum"] == stream_checksum(frame_sums)


@pytest.mark.parametrize("dtype", DTYPES)
def test_golden_assembles(dtype):
    handoff = receive(golden_path(dtype_name(dtype)).read_bytes(), chunk=5)
    assert torch.equal(bits(handoff.streams["cond"].rows), bits(golden_rows(dtype, 4)))
    assert torch.equal(bits(handoff.streams["uncond"].rows), bits(golden_rows(dtype, 2, offset=100)))
    assert handoff.streams["cond"].token_ids == [11, 12, 13, 14, 15]
    assert handoff.streams["cond"].answer_start_index == 3
    assert handoff.close.cache_creation_tokens == 3


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [1, 13, 4096, 1 << 20])
def test_round_trip_every_dtype_and_chunking(dtype, chunk):
    rows = (torch.randn(9, 8, generator=torch.Generator().manual_seed(1)) * 100).to(dtype)
    name = str(dtype).removeprefix("torch.")
    enc = HandoffEncoder(make_open(dtype=name), max_frame_payload=40)
    wire = join(
        enc.open_frame()
        + enc.rows("cond", 0, list(range(6)), rows[:6])
        + enc.rows("cond", 6, [6, 7, 8], rows[6:])
        + enc.close({"cond": list(range(10))}, {"cond": 6}, cached_tokens=0, cache_creation_tokens=6)
    )
    handoff = receive(wire, chunk=chunk)
    got = handoff.streams["cond"].rows
    assert got.dtype == dtype and got.shape == (9, 8)
    assert torch.equal(bits(got), bits(rows))


def test_bf16_special_values_are_bit_exact():
    # +0, -0, +inf, -inf, a NaN payload, the smallest subnormal, the largest finite, 1.0
    words = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x7F7F, 0x3F80]
    patterns = torch.tensor([w - 0x10000 if w >= 0x8000 else w for w in words], dtype=torch.int16)
    rows = patterns.view(torch.bfloat16).reshape(1, 8)
    enc = HandoffEncoder(make_open(max_rows=1, prompt=1))
    wire = join(enc.open_frame() + enc.rows("cond", 0, [5], rows) + enc.close({"cond": [5, 6]}, {"cond": 1}, 0, 1))
    assert torch.equal(receive(wire).streams["cond"].rows.view(torch.int16), patterns.reshape(1, 8))


def test_plain_decode_path_matches():
    rows = golden_rows(torch.bfloat16, 3)
    frame, wire = encode_rows("r", "cond", 0, [1, 2, 3], rows)
    decoded = decode_frame(join(wire))
    assert decoded.frame == frame
    assert decoded.rows is not None
    assert torch.equal(bits(decoded.rows), bits(rows))


def test_plain_decode_path_checks_the_payload():
    _, wire = encode_rows("r", "cond", 0, [1, 2, 3], golden_rows(torch.bfloat16, 3))
    data = bytearray(join(wire))
    data[-1] ^= 0x40
    with pytest.raises(errors.ChecksumMismatch):
        decode_frame(bytes(data))


def test_encoder_payload_is_the_tensor_memory_itself():
    rows = golden_rows(torch.bfloat16, 3)
    _, (prefix, payload) = encode_rows("r", "cond", 0, [1, 2, 3], rows)
    assert isinstance(payload, memoryview) and payload.nbytes == rows.nbytes
    rows[0, 0] = 42.0  # the buffer aliases the tensor: no copy was made
    assert bytes(payload[:2]) == bytes(tensor_bytes(rows[:1, :1]))
    assert prefix[-5] == 0xC6 and int.from_bytes(prefix[-4:], "big") == rows.nbytes


def test_rows_land_by_index_out_of_order(encoder, rows):
    enc = encoder
    groups = [enc.rows("cond", 0, [0, 1, 2], rows[:3]), enc.rows("cond", 3, [3, 4, 5, 6], rows[3:])]
    close = enc.close({"cond": list(range(8))}, {"cond": 6}, 0, 6)
    wire = join(enc.open_frame() + groups[1] + groups[0] + close)
    assert torch.equal(bits(receive(wire).streams["cond"].rows), bits(rows))


# --- rejections -------------------------------------------------------------------------------


def sent(encoder, rows) -> bytes:
    """open + all seven rows, through ``encoder`` (so its close reports them)."""
    return join(encoder.open_frame() + encoder.rows("cond", 0, list(range(7)), rows))


def expect(error: type[errors.HandoffError], data: bytes, **kwargs) -> errors.HandoffError:
    receiver = HandoffReceiver(**kwargs)
    with pytest.raises(error) as info:
        receiver.feed(data)
        receiver.finish()
    assert receiver.assembler.allocated_bytes == 0  # nothing stays allocated after a rejection
    return info.value


def good_close(encoder) -> bytes:
    return join(encoder.close({"cond": list(range(8))}, {"cond": 6}, 0, 6))


def test_reject_unknown_schema_version():
    bad = make_open().model_dump() | {"v": SCHEMA_VERSION + 1}
    expect(errors.UnsupportedSchemaVersion, raw(bad))


def test_reject_unknown_kind():
    expect(errors.UnknownFrameKind, raw({"v": SCHEMA_VERSION, "kind": "rowz", "request_id": "x"}))


def test_reject_dtype_not_on_allow_list():
    bad = make_open().model_dump() | {"dtype": "float64"}
    expect(errors.DtypeNotAllowed, raw(bad))


def test_reject_rows_dtype_not_on_allow_list(encoder):
    header = {
        "v": SCHEMA_VERSION,
        "kind": "rows",
        "request_id": "req_test",
        "stream": "cond",
        "start": 0,
        "count": 1,
        "token_ids": ids(1),
        "dtype": "int8",
        "shape": [1, 8],
        "checksum": payload_checksum(b"\0" * 8),
        "data": b"\0" * 8,
    }
    expect(errors.DtypeNotAllowed, join(encoder.open_frame()) + raw(header))


def test_reject_shape_byte_length_mismatch(encoder):
    header = {
        "v": SCHEMA_VERSION,
        "kind": "rows",
        "request_id": "req_test",
        "stream": "cond",
        "start": 0,
        "count": 2,
        "token_ids": ids(1, 2),
        "dtype": "bfloat16",
        "shape": [2, 8],
        "checksum": "0" * 16,
        "data": b"\0" * 30,
    }
    expect(errors.ShapeMismatch, join(encoder.open_frame()) + raw(header))


def test_reject_shape_not_matching_row_width(encoder):
    header = {
        "v": SCHEMA_VERSION,
        "kind": "rows",
        "request_id": "req_test",
        "stream": "cond",
        "start": 0,
        "count": 2,
        "token_ids": ids(1, 2),
        "dtype": "bfloat16",
        "shape": [4, 4],
        "checksum": payload_checksum(b"\0" * 32),
        "data": b"\0" * 32,
    }
    expect(errors.ShapeMismatch, join(encoder.open_frame()) + raw(header))


def test_reject_rows_outside_declared_bound(encoder):
    past_end = torch.zeros(4, 8, dtype=torch.bfloat16)  # rows [8, 12) of a stream with max_rows=10
    expect(errors.RowsOutOfBounds, join(encoder.open_frame()) + rows_frame(8, past_end))


def rows_frame(start: int, rows: torch.Tensor, stream: StreamName = "cond") -> bytes:
    _, wire = encode_rows("req_test", stream, start, list(range(start, start + rows.shape[0])), rows)
    return join(wire)


def test_reject_undeclared_stream(encoder, rows):
    expect(errors.RowsOutOfBounds, join(encoder.open_frame()) + rows_frame(0, rows[:1], stream="uncond"))


def test_reject_duplicate_rows(encoder, rows):
    expect(errors.OverlappingRows, sent(encoder, rows) + rows_frame(0, rows[:2]))


def test_reject_overlapping_rows(encoder, rows):
    first = join(encoder.open_frame()) + rows_frame(0, rows[:4])
    expect(errors.OverlappingRows, first + rows_frame(3, rows[3:5]))


def test_reject_token_id_count_in_rows_frame(encoder, rows):
    header = {
        "v": SCHEMA_VERSION,
        "kind": "rows",
        "request_id": "req_test",
        "stream": "cond",
        "start": 0,
        "count": 2,
        "token_ids": ids(1),
        "dtype": "bfloat16",
        "shape": [2, 8],
        "checksum": payload_checksum(b"\0" * 32),
        "data": b"\0" * 32,
    }
    expect(errors.TokenCountMismatch, join(encoder.open_frame()) + raw(header))


def test_reject_close_token_ids_disagreeing_with_rows(encoder, rows):
    wire = sent(encoder, rows)
    expect(errors.TokenCountMismatch, wire + join(encoder.close({"cond": [9] * 8}, {"cond": 6}, 0, 6)))


def test_reject_close_token_count(encoder, rows):
    wire = sent(encoder, rows)
    expect(errors.TokenCountMismatch, wire + join(encoder.close({"cond": list(range(3))}, {"cond": 2}, 0, 6)))


def test_reject_missing_rows_at_close(encoder, rows):
    partial = join(encoder.open_frame() + encoder.rows("cond", 0, list(range(5)), rows[:5]))
    close = msgpack.unpackb(good_close(encoder))
    close["streams"]["cond"]["rows"] = 7
    expect(errors.RowCountMismatch, partial + raw(close))


def test_reject_checksum_mismatch(encoder, rows):
    wire = sent(encoder, rows)
    close = msgpack.unpackb(good_close(encoder))
    close["streams"]["cond"]["checksum"] = "0" * 16
    expect(errors.ChecksumMismatch, wire + raw(close))


def test_reject_corrupted_row_bytes(encoder, rows):
    wire = bytearray(sent(encoder, rows) + good_close(encoder))
    wire[wire.index(b"data") + 10] ^= 0x01
    expect(errors.ChecksumMismatch, bytes(wire))


def test_reject_frames_after_close(encoder, rows):
    wire = sent(encoder, rows)
    wire += good_close(encoder)
    expect(errors.FrameAfterClose, wire + join(encoder.abort("late")))


def test_reject_frames_before_open(rows):
    enc = HandoffEncoder(make_open())
    expect(errors.FrameOutOfOrder, join(enc.rows("cond", 0, [1], rows[:1])))


def test_reject_oversize_payload(encoder, rows):
    expect(errors.FrameTooLarge, sent(encoder, rows), limits=FrameLimits(max_payload_bytes=64))


@pytest.mark.parametrize(
    "token_ids",
    [b"\x01\x00\x00\x00\x02\x00\x00", [1, 2]],  # not whole uint32s; the version-1 int array
    ids=["ragged_bytes", "int_array"],
)
def test_reject_token_ids_not_uint32_bytes(encoder, token_ids):
    header = {
        "v": SCHEMA_VERSION,
        "kind": "rows",
        "request_id": "req_test",
        "stream": "cond",
        "start": 0,
        "count": 2,
        "token_ids": token_ids,
        "dtype": "bfloat16",
        "shape": [2, 8],
        "checksum": payload_checksum(b"\0" * 32),
        "data": b"\0" * 32,
    }
    err = expect(errors.MalformedFrame, join(encoder.open_frame()) + raw(header))
    assert "token_ids" in str(err)


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.0]])
def test_encoder_refuses_token_ids_that_are_not_uint32(bad):
    with pytest.raises(ValueError):
        encode_rows("r", "cond", 0, bad, golden_rows(torch.bfloat16, 1))


def test_reject_header_over_the_limit_that_parses_after_a_large_chunk():
    """A header buffered across chunks is held to the limit even when the last chunk completes it."""
    data = raw(make_open().model_dump() | {"padding": "x" * 900})
    receiver = HandoffReceiver(limits=FrameLimits(max_header_bytes=1024))
    receiver.feed(data[:600])
    with pytest.raises(errors.FrameTooLarge):
        receiver.feed(data[600:])
    assert receiver.assembler.allocated_bytes == 0


def test_reject_oversize_header():
    huge = make_open().model_dump() | {"padding": "x" * 5000}
    expect(errors.FrameTooLarge, raw(huge), limits=FrameLimits(max_header_bytes=1024))


def test_reject_allocation_over_cap_before_allocating():
    opened = make_open(max_rows=30000, hidden=8)
    err = expect(errors.AllocationTooLarge, join(HandoffEncoder(opened).open_frame()), caps=AssemblyCaps(max_rows=1000))
    assert err.status == 413


def test_reject_byte_cap_before_allocating():
    opened = make_open(max_rows=1000, hidden=4096, dtype="float32")
    expect(errors.AllocationTooLarge, join(HandoffEncoder(opened).open_frame()), caps=AssemblyCaps(max_bytes=1 << 20))


def test_abort_releases(encoder, rows):
    expect(errors.HandoffAborted, sent(encoder, rows) + join(encoder.abort("client went away")))


def test_stream_ending_inside_a_frame(encoder, rows):
    wire = sent(encoder, rows)
    expect(errors.IncompleteStream, wire[:-3])


def test_stream_ending_without_close(encoder, rows):
    expect(errors.IncompleteStream, sent(encoder, rows))


def test_reject_not_a_map():
    expect(errors.MalformedFrame, msgpack.packb([1, 2, 3]))


def test_reject_data_not_last(encoder):
    header = {
        "v": SCHEMA_VERSION,
        "kind": "rows",
        "request_id": "req_test",
        "stream": "cond",
        "data": b"\0" * 16,
        "start": 0,
        "count": 1,
        "token_ids": ids(1),
        "dtype": "bfloat16",
        "shape": [1, 8],
        "checksum": payload_checksum(b"\0" * 16),
    }
    expect(errors.MalformedFrame, join(encoder.open_frame()) + raw(header))


def test_reject_wrong_field_type():
    bad = make_open().model_dump() | {"row_width": "8"}
    expect(errors.MalformedFrame, raw(bad))


def test_the_row_width_travels_under_its_own_name_beside_the_whole_row_recipe():
    header = frame_header(make_open())
    assert header["row_width"] == 8 and "hidden_size" not in header
    assert not {"layers", "final_norm", "conditioning"} & header.keys()
    assert header["rows"] == RowRecipe(layers=[30]).model_dump()


def test_a_chat_template_recipe_arrives_as_sent_its_template_of_none_included():
    recipe = RowRecipe(
        layers=[9, 18, 27],
        final_norm=False,
        template=None,
        chat_template_kwargs={"enable_thinking": False},
        drops_template=False,
        conditioning="every_row",
    )
    receiver = HandoffReceiver()
    receiver.feed(join(HandoffEncoder(make_open().model_copy(update={"rows": recipe})).open_frame()))
    assert receiver.assembler.open is not None and receiver.assembler.open.rows == recipe


def test_reject_a_version_4_open_frame():
    v4 = make_open().model_dump(exclude={"rows", "row_width"}) | {
        "v": 4,
        "hidden_size": 8,
        "layers": [30],
        "final_norm": True,
        "conditioning": "qwen_image",
    }
    expect(errors.UnsupportedSchemaVersion, raw(v4))


def test_prefix_tokens_travel_in_open_and_are_optional_on_the_wire(encoder, rows):
    receiver = HandoffReceiver()
    receiver.feed(sent(encoder, rows) + good_close(encoder))
    assert receiver.finish().streams["cond"].prefix_tokens is None  # make_open sends none
    with_prefix = make_open().model_dump()
    with_prefix["streams"]["cond"]["prefix_tokens"] = 2
    receiver = HandoffReceiver()
    receiver.feed(raw(with_prefix))
    assert receiver.assembler.open is not None and receiver.assembler.open.streams["cond"].prefix_tokens == 2


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_traceparent_travels_in_open_and_is_optional_on_the_wire():
    assert "traceparent" not in frame_header(make_open())  # no trace, no key: the golden bytes hold
    receiver = HandoffReceiver()
    receiver.feed(raw(make_open().model_dump(exclude_none=True) | {"traceparent": TRACEPARENT}))
    assert receiver.assembler.open is not None and receiver.assembler.open.traceparent == TRACEPARENT


@pytest.mark.parametrize(
    "traceparent",
    [
        "0af7651916cd43dd8448eb211c80319c",
        "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b716920333-01",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-has a space",
    ],
)
def test_reject_a_traceparent_that_is_not_w3c(traceparent):
    expect(errors.MalformedFrame, raw(make_open().model_dump(exclude_none=True) | {"traceparent": traceparent}))


def test_a_later_traceparent_version_may_append_fields():
    later = "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra"
    receiver = HandoffReceiver()
    receiver.feed(raw(make_open().model_dump(exclude_none=True) | {"traceparent": later}))
    assert receiver.assembler.open is not None and receiver.assembler.open.traceparent == later


def test_reject_prefix_longer_than_the_prompt():
    bad = make_open(prompt=6).model_dump()
    bad["streams"]["cond"]["prefix_tokens"] = 7
    expect(errors.MalformedFrame, raw(bad))


def test_reject_rows_frame_without_data():
    # A rows header with no 'data' entry, naming a stream open never declared: typed, not a crash.
    header = {
        "v": SCHEMA_VERSION,
        "kind": "rows",
        "request_id": "req_test",
        "stream": "uncond",
        "start": 0,
        "count": 0,
        "token_ids": b"",
        "dtype": "bfloat16",
        "shape": [0, 8],
        "checksum": "0" * 16,
    }
    expect(errors.MalformedFrame, raw(make_open().model_dump()) + raw(header))


@pytest.mark.parametrize(
    "layers",
    [[], list(range(9)), [-1], [8.0], 8, None],
    ids=["none", "past-eight", "negative", "float", "a-bare-int", "null"],
)
def test_reject_an_open_whose_layers_are_not_one_to_eight_layer_numbers(layers):
    """Counted from the start too: a card counts layers from the end, the AR resolves them before they travel."""
    bad = make_open().model_dump()
    bad["rows"]["layers"] = layers
    expect(errors.MalformedFrame, raw(bad))


def test_a_version_3_open_naming_one_layer_is_refused_as_another_version():
    old = {k: v for k, v in make_open().model_dump().items() if k != "layers"} | {"v": 3, "layer": 30}
    expect(errors.UnsupportedSchemaVersion, raw(old))
