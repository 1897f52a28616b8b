"""Property-based: round trips for arbitrary rows and splits; random corruption never crashes."""

from __future__ import annotations

import itertools

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.errors import HandoffError
from shared.handoff_assembler import HandoffReceiver
from shared.handoff_encoder import HandoffEncoder
from tests.contract.conftest import join, make_open

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
INT_VIEW = {2: torch.int16, 4: torch.int32}


@st.composite
def handoffs(draw):
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    hidden = draw(st.integers(1, 12))
    n_rows = draw(st.integers(0, 20))
    itemsize = DTYPES[dtype].itemsize
    # Arbitrary bit patterns (NaNs, infinities, subnormals included) must survive unchanged.
    words = draw(
        st.lists(
            st.integers(-(1 << (8 * itemsize - 1)), (1 << (8 * itemsize - 1)) - 1),
            min_size=n_rows * hidden,
            max_size=n_rows * hidden,
        )
    )
    rows = torch.tensor(words, dtype=INT_VIEW[itemsize]).view(DTYPES[dtype]).reshape(n_rows, hidden)
    cuts = sorted(set(draw(st.lists(st.integers(0, n_rows), max_size=4))) | {0, n_rows})
    max_payload = draw(st.integers(1, 64))
    chunk = draw(st.integers(1, 200))
    return dtype, rows, cuts, max_payload, chunk


def encode(dtype: str, rows: torch.Tensor, cuts: list[int], max_payload: int) -> tuple[bytes, list[int]]:
    n = rows.shape[0]
    enc = HandoffEncoder(make_open(dtype=dtype, hidden=rows.shape[1], max_rows=max(n, 1), prompt=n), max_payload)
    token_ids = [(i * 7919) % 50000 for i in range(n + 1)]
    buffers = enc.open_frame()
    for a, b in itertools.pairwise(cuts):
        if b > a:
            buffers += enc.rows("cond", a, token_ids[a:b], rows[a:b])
    buffers += enc.close({"cond": token_ids}, {"cond": n}, cached_tokens=0, cache_creation_tokens=n)
    return join(buffers), token_ids


def feed(data: bytes, chunk: int):
    receiver = HandoffReceiver()
    for i in range(0, len(data), chunk):
        receiver.feed(data[i : i + chunk])
    return receiver, receiver.finish()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(handoffs())
def test_round_trip(case):
    dtype, rows, cuts, max_payload, chunk = case
    data, token_ids = encode(dtype, rows, cuts, max_payload)
    _, handoff = feed(data, chunk)
    got = handoff.streams["cond"]
    view = INT_VIEW[rows.element_size()]
    assert torch.equal(got.rows.view(view), rows.view(view))
    assert got.token_ids == token_ids


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(handoffs(), st.data())
def test_corruption_gives_typed_error_or_correct_result(case, data):
    dtype, rows, cuts, max_payload, chunk = case
    wire, token_ids = encode(dtype, rows, cuts, max_payload)
    corrupted = bytearray(wire)
    action = data.draw(st.sampled_from(["flip", "truncate", "insert", "delete"]))
    at = data.draw(st.integers(0, len(corrupted) - 1))
    if action == "flip":
        corrupted[at] ^= data.draw(st.integers(1, 255))
    elif action == "truncate":
        del corrupted[at:]
    elif action == "insert":
        corrupted[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    else:
        del corrupted[at : at + data.draw(st.integers(1, 8))]
    receiver = HandoffReceiver()
    try:
        for i in range(0, len(corrupted), chunk):
            receiver.feed(bytes(corrupted[i : i + chunk]))
        handoff = receiver.finish()
    except HandoffError:
        assert receiver.assembler.allocated_bytes == 0
        return
    # Accepted: then what the contract protects must be exactly what was sent: the rows (checksums)
    # and each row's token id (carried twice, by its rows frame and by close). The rest of close's
    # header — counts, timings, the last sampled token, which has no row — has no checksum
    # (HANDOFF_SPEC.md, "What the checksums cover"): a flip there is the transport's to catch.
    view = INT_VIEW[rows.element_size()]
    assert torch.equal(handoff.streams["cond"].rows.view(view), rows.view(view))
    assert handoff.streams["cond"].token_ids[: rows.shape[0]] == token_ids[: rows.shape[0]]
