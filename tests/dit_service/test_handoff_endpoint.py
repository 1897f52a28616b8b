"""POST /v1/handoff on a real server: complete streams render, every violation is a typed 4xx,
and whatever ends a handoff gives its row memory back."""

from __future__ import annotations

import io
from typing import Any

import httpx
import msgpack
import pytest
import torch
from PIL import Image

from dit_service.app import create_dit_app
from dit_service.settings import DitSettings
from shared.diffusion import MAX_SEED
from shared.frame_codec import encode_frame, encode_rows
from shared.frames import SCHEMA_VERSION, CloseFrame, EditSpec, PictureSpec, StreamTotals, frame_header
from shared.handoff_encoder import HandoffEncoder
from shared.result_frames import DoneFrame
from shared.tensor_codec import token_ids_to_bytes
from tests.dit_service.handoff_requests import (
    HIDDEN,
    RawHandoff,
    complete_handoff,
    handoff_headers,
    hidden_rows,
    metric,
    open_frame,
    params,
    post_handoff,
    token_ids,
)
from tests.support.live_server import LiveServer
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

ROWS = 12


def assert_released(url: str) -> None:
    wait_for(lambda: metric(url, "ardit_dit_handoff_buffer_bytes") == 0, what="the handoff's buffer freed")
    wait_for(lambda: metric(url, "ardit_dit_handoffs_in_flight") == 0, what="no handoff in flight")


def image_of(frame) -> Image.Image:
    image = Image.open(io.BytesIO(frame.data))
    image.load()
    return image


# --- complete handoffs --------------------------------------------------------------------------


def test_complete_handoff_renders_an_image_of_the_requested_size(dit_server):
    answer = post_handoff(dit_server.url, complete_handoff(hidden_rows(ROWS), diffusion=params(width=48, height=32)))
    assert answer.status == 200, answer.error
    assert answer.headers["content-type"] == "application/vnd.ardit.result+msgpack"
    assert answer.kinds == ["image", "done"]
    image = image_of(answer.images[0])
    assert image.format == "PNG" and image.size == (48, 32)
    assert (answer.images[0].width, answer.images[0].height) == (48, 32)
    done = answer.frames[-1]
    assert isinstance(done, DoneFrame)
    assert set(done.timings) >= {"queue", "denoise", "vae_decode", "encode", "total"}
    assert_released(dit_server.url)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rows_are_accepted(dit_server, dtype):
    answer = post_handoff(dit_server.url, complete_handoff(hidden_rows(ROWS, dtype=dtype)))
    assert answer.status == 200, answer.error
    assert answer.kinds == ["image", "done"]


def test_out_of_order_row_frames_assemble_to_the_same_image(dit_server):
    rows = hidden_rows(ROWS, seed=3)
    in_order = post_handoff(dit_server.url, complete_handoff(rows, frame_rows=5))
    reversed_ = post_handoff(dit_server.url, complete_handoff(rows, frame_rows=5, reverse=True))
    assert in_order.status == reversed_.status == 200
    assert in_order.images[0].data == reversed_.images[0].data


def edit_handoff(
    *, mask: bool, send_mask: bool = True, width: int = 32, height: int = 32, edit: EditSpec | None = None
) -> list[bytes]:
    """An edit as the AR sends it: open (with edit: one picture at the output size and a strength, or ``edit``), the
    pictures' and the mask's pixels, rows, close."""
    picture = PictureSpec(width=width, height=height)
    edit = edit or EditSpec(pictures=[picture], strength=0.75, mask=mask)
    encoder = HandoffEncoder(open_frame(ROWS, diffusion=params(width=width, height=height), edit=edit))
    parts = list(encoder.open_frame())
    for index, sent in enumerate(edit.pictures):
        parts += encoder.pixels("image", index, bytes(range(256)) * (sent.width * sent.height * 3 // 256))
    if mask and send_mask:
        parts += encoder.pixels("mask", 0, bytes([0, 255]) * (width * height // 2))
    parts += encoder.rows("cond", 0, token_ids(ROWS), hidden_rows(ROWS))
    parts += encoder.close({"cond": token_ids(ROWS)}, {"cond": ROWS}, cached_tokens=0, cache_creation_tokens=0)
    return [bytes(p) for p in parts]


@pytest.mark.parametrize("mask", [False, True], ids=["img2img", "inpaint"])
def test_an_edit_handoff_renders_from_its_image(dit_server, mask):
    answer = post_handoff(dit_server.url, edit_handoff(mask=mask, width=48, height=32))
    assert answer.status == 200, answer.error
    assert answer.kinds == ["image", "done"] and image_of(answer.images[0]).size == (48, 32)
    assert_released(dit_server.url)


def test_an_edit_without_its_announced_mask_is_refused_and_releases_memory(dit_server):
    answer = post_handoff(dit_server.url, edit_handoff(mask=True, send_mask=False))
    assert answer.status == 400 and answer.refusal["code"] == "missing_pixels"
    assert_released(dit_server.url)


def test_a_picture_over_the_pixel_limit_allocates_nothing(dit_server):
    # The DiT's max_pixels caps each picture of an edit before any pixel memory exists.
    side = int(DitSettings().max_pixels ** 0.5) + 16
    edit = EditSpec(pictures=[PictureSpec(width=side, height=side)], strength=0.5)
    opened = open_frame(ROWS, edit=edit)
    answer = post_handoff(dit_server.url, [bytes(p) for p in HandoffEncoder(opened).open_frame()])
    assert answer.status == 413 and answer.refusal["code"] == "allocation_too_large"
    assert_released(dit_server.url)


@pytest.mark.parametrize(
    ("pictures", "strength", "param"), [(2, 0.5, "image"), (1, None, "strength")], ids=["two-pictures", "no-strength"]
)
def test_an_edit_qwen_image_cannot_draw_is_refused_at_open_before_its_pixels(dit_server, pictures, strength, param):
    """Qwen-Image's img2img starts from one picture noised to a strength: two pictures, or none, are refused when
    ``open`` arrives, before a pixel lands (none is counted as received)."""
    received = metric(dit_server.url, "ardit_dit_handoff_received_frames_total")
    edit = EditSpec(pictures=[PictureSpec(width=32, height=32)] * pictures, strength=strength)
    answer = post_handoff(dit_server.url, edit_handoff(mask=False, edit=edit))
    assert answer.status == 422 and answer.refusal["code"] == "invalid_diffusion_params"
    assert answer.refusal["param"] == param
    assert metric(dit_server.url, "ardit_dit_handoff_received_frames_total") == received + 1  # the open frame
    assert_released(dit_server.url)


def test_body_sent_in_tiny_chunks_is_reassembled(dit_server):
    whole = b"".join(complete_handoff(hidden_rows(ROWS, seed=3)))
    pieces = [whole[i : i + 7] for i in range(0, len(whole), 7)]
    reference = post_handoff(dit_server.url, [whole])
    answer = post_handoff(dit_server.url, pieces)
    assert answer.status == 200
    assert answer.images[0].data == reference.images[0].data


# --- contract violations -------------------------------------------------------------------------


def _handoff(**open_options) -> tuple[HandoffEncoder, list[bytes]]:
    encoder = HandoffEncoder(open_frame(ROWS, **open_options))
    return encoder, [bytes(b) for b in encoder.open_frame()]


def _rows(encoder: HandoffEncoder, start: int, count: int) -> list[bytes]:
    rows = hidden_rows(count, seed=start)
    return [bytes(b) for b in encoder.rows("cond", start, token_ids(count, first=100 + start), rows)]


def _close(encoder: HandoffEncoder, ids: list[int] | None = None) -> list[bytes]:
    ids = ids or token_ids(ROWS)
    return [bytes(b) for b in encoder.close({"cond": ids}, {"cond": ROWS}, 0, 0)]


def _raw(frame: dict) -> bytes:
    return msgpack.packb(frame, use_bin_type=True)


def bad_schema_version():
    header = frame_header(open_frame(ROWS))
    return [_raw({**header, "v": SCHEMA_VERSION + 1})]


def unknown_kind():
    _, parts = _handoff()
    return [*parts, _raw({"v": SCHEMA_VERSION, "kind": "teleport", "request_id": "req_test"})]


def bad_dtype_in_open():
    return [encode_frame(open_frame(ROWS, dtype="int8"))]


def rows_dtype_differs_from_open():
    _, parts = _handoff()
    _, wire = encode_rows("req_test", "cond", 0, token_ids(2), hidden_rows(2, dtype=torch.float16))
    return parts + [bytes(b) for b in wire]


def shape_mismatch():
    _, parts = _handoff()
    _, wire = encode_rows("req_test", "cond", 0, token_ids(2), torch.zeros(2, HIDDEN // 2))
    return parts + [bytes(b) for b in wire]


def rows_out_of_bounds():
    encoder, parts = _handoff()
    return parts + _rows(encoder, ROWS - 1, 2)


def overlapping_rows():
    encoder, parts = _handoff()
    return parts + _rows(encoder, 0, 4) + _rows(encoder, 2, 4)


def token_id_mismatch():
    encoder, parts = _handoff()
    return parts + _rows(encoder, 0, ROWS) + _close(encoder, ids=token_ids(ROWS, first=7))


def checksum_mismatch():
    encoder, parts = _handoff()
    close = CloseFrame(
        request_id="req_test",
        streams={
            "cond": StreamTotals(
                rows=ROWS, token_ids=token_ids_to_bytes(token_ids(ROWS)), answer_start_index=ROWS, checksum="0" * 16
            )
        },
        cached_tokens=0,
        cache_creation_tokens=0,
    )
    return parts + _rows(encoder, 0, ROWS) + [encode_frame(close)]


def corrupt_payload():
    encoder, parts = _handoff()
    rows = _rows(encoder, 0, ROWS)
    payload = bytearray(rows[1])
    payload[0] ^= 0xFF
    return [*parts, rows[0], bytes(payload)]


def frame_after_close():
    encoder, parts = _handoff()
    return parts + _rows(encoder, 0, ROWS) + _close(encoder) + [encode_frame(open_frame(ROWS))]


def frame_before_open():
    encoder = HandoffEncoder(open_frame(ROWS))
    return _rows(encoder, 0, 2)


def oversize_frame():
    # 64 rows x 576 x 4 bytes = 147 KiB in one frame, over the server's 64 KiB frame limit.
    encoder = HandoffEncoder(open_frame(64))
    rows = hidden_rows(64)
    return [bytes(b) for b in encoder.open_frame() + encoder.rows("cond", 0, token_ids(64), rows)]


def oversize_allocation():
    # 4000 rows x 576 x 4 bytes = 9.2 MB, over the server's 4 MiB buffer cap.
    return [encode_frame(open_frame(ROWS, max_rows=4000))]


def aborted():
    encoder, parts = _handoff()
    return parts + _rows(encoder, 0, 4) + [bytes(b) for b in encoder.abort("engine died")]


def ends_without_close():
    encoder, parts = _handoff()
    return parts + _rows(encoder, 0, ROWS)


def ends_inside_a_frame():
    encoder, parts = _handoff()
    rows = _rows(encoder, 0, ROWS)
    return [*parts, rows[0], rows[1][:100]]


def garbage():
    return [b"\xc1\xc1\xc1 this is not msgpack"]


VIOLATIONS = [
    (bad_schema_version, 400, "unsupported_schema_version"),
    (unknown_kind, 400, "unknown_frame_kind"),
    (bad_dtype_in_open, 400, "dtype_not_allowed"),
    (rows_dtype_differs_from_open, 400, "dtype_not_allowed"),
    (shape_mismatch, 400, "shape_mismatch"),
    (rows_out_of_bounds, 400, "rows_out_of_bounds"),
    (overlapping_rows, 400, "overlapping_rows"),
    (token_id_mismatch, 400, "token_count_mismatch"),
    (checksum_mismatch, 400, "checksum_mismatch"),
    (corrupt_payload, 400, "checksum_mismatch"),
    (frame_after_close, 400, "frame_after_close"),
    (frame_before_open, 400, "frame_out_of_order"),
    (oversize_frame, 413, "frame_too_large"),
    (oversize_allocation, 413, "allocation_too_large"),
    (aborted, 409, "aborted_by_sender"),
    (ends_without_close, 400, "incomplete_stream"),
    (ends_inside_a_frame, 400, "incomplete_stream"),
    (garbage, 400, "malformed_frame"),
]


@pytest.mark.parametrize("make_body, status, code", VIOLATIONS, ids=[v[0].__name__ for v in VIOLATIONS])
def test_contract_violation_is_a_typed_4xx_and_releases_memory(dit_server, make_body, status, code):
    failures = metric(dit_server.url, "ardit_dit_handoff_failures_total", reason=code)
    answer = post_handoff(dit_server.url, make_body())
    assert answer.status == status
    assert answer.refusal["code"] == code
    assert answer.refusal["type"] == "handoff_error"
    assert answer.refusal["message"]
    assert metric(dit_server.url, "ardit_dit_handoff_failures_total", reason=code) == failures + 1
    assert_released(dit_server.url)


# --- the open frame against this DiT ---------------------------------------------------------------


@pytest.mark.parametrize(
    "open_options, param",
    [
        ({"hidden": 64}, "row_width"),
        ({"conditioning": "telepathy"}, "conditioning"),
        ({"model": "some-other-llm"}, "model"),
        ({"prefix_tokens": None}, "prompt"),
    ],
    ids=["row_width", "conditioning", "model", "no_prefix_tokens"],
)
def test_conditioning_mismatch_is_refused_at_open(dit_server, open_options, param):
    hidden = open_options.get("hidden", HIDDEN)
    answer = post_handoff(dit_server.url, complete_handoff(hidden_rows(ROWS, hidden=hidden), **open_options))
    assert answer.status == 422
    assert answer.refusal["code"] == "conditioning_mismatch"
    assert answer.refusal["param"] == param
    assert_released(dit_server.url)


def test_a_dit_whose_card_names_a_layer_announces_it_refuses_rows_of_another_and_renders_that_layers(layer_8_server):
    assert httpx.get(f"{layer_8_server.url}/readyz").json()["capabilities"]["rows"]["layers"] == [8]
    refusals: list[tuple[dict[str, Any], str]] = [
        ({"layers": (7,)}, "layers"),
        ({"layers": (30,)}, "layers"),
        ({"layers": (8, 16)}, "layers"),
        ({"layers": (8,), "final_norm": False}, "final_norm"),
    ]
    for options, param in refusals:
        refused = post_handoff(layer_8_server.url, complete_handoff(hidden_rows(ROWS), **options))
        assert refused.status == 422
        assert refused.refusal["code"] == "conditioning_mismatch" and refused.refusal["param"] == param
        assert_released(layer_8_server.url)
    answer = post_handoff(layer_8_server.url, complete_handoff(hidden_rows(ROWS), layers=(8,)))
    assert answer.status == 200, answer.error


@pytest.mark.parametrize(
    "diffusion, param",
    [
        (params(width=40), "size"),
        (params(height=24), "size"),
        (params(width=2048, height=2048), "size"),
        (params(num_inference_steps=1), "num_inference_steps"),
        (params(num_inference_steps=101), "num_inference_steps"),
        (params(num_images=11), "n"),
        (params(guidance_scale=4.0), "guidance_scale"),
        (params(guidance_scale=float("inf")), "guidance_scale"),
        (params(seed=MAX_SEED, num_images=2), "seed"),
    ],
    ids=[
        "width",
        "height",
        "pixels",
        "one_step",
        "too_many_steps",
        "images",
        "cfg_without_uncond",
        "inf_guidance",
        "seed_overflow",
    ],
)
def test_diffusion_params_the_model_cannot_honour_are_refused(dit_server, diffusion, param):
    answer = post_handoff(dit_server.url, complete_handoff(hidden_rows(ROWS), diffusion=diffusion))
    assert answer.status == 422
    assert answer.refusal["code"] == "invalid_diffusion_params"
    assert answer.refusal["param"] == param
    assert_released(dit_server.url)


def test_prompt_longer_than_max_sequence_length_is_refused(dit_server):
    answer = post_handoff(dit_server.url, complete_handoff(hidden_rows(70), frame_rows=16))
    assert answer.status == 422
    assert answer.refusal["code"] == "prompt_too_long"
    assert answer.refusal["message"] == "prompt too long for the DiT (70 > 64 rows)"
    assert answer.refusal["param"] == "prompt"
    assert_released(dit_server.url)


# --- auth and admission ---------------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_missing_or_wrong_token_is_401(dit_server, token):
    answer = post_handoff(dit_server.url, complete_handoff(hidden_rows(ROWS)), headers=handoff_headers(token))
    assert answer.status == 401
    assert answer.refusal["code"] == "invalid_handoff_token"
    assert answer.headers["www-authenticate"] == "Bearer"


def test_wrong_media_type_is_415(dit_server):
    headers = {**handoff_headers(), "content-type": "application/json"}
    answer = post_handoff(dit_server.url, complete_handoff(hidden_rows(ROWS)), headers=headers)
    assert answer.status == 415
    assert answer.refusal["code"] == "unsupported_media_type"


def test_stalled_handoff_times_out_and_releases_memory(dit_server):
    stalled = RawHandoff(dit_server.port)
    try:
        encoder = HandoffEncoder(open_frame(ROWS))
        stalled.send(b"".join(bytes(b) for b in encoder.open_frame()))
        wait_for(lambda: metric(dit_server.url, "ardit_dit_handoff_buffer_bytes") > 0)
        status, body = stalled.response()  # the server gives up after its 1 s stall timeout
    finally:
        stalled.close()
    assert status == 408
    assert body["error"]["code"] == "handoff_stalled"
    assert body["error"]["type"] == "handoff_error"
    assert_released(dit_server.url)


def test_full_places_answer_429_with_retry_after(narrow_server):
    holder = RawHandoff(narrow_server.port)
    try:
        holder.send(b"".join(bytes(b) for b in HandoffEncoder(open_frame(ROWS)).open_frame()))
        wait_for(lambda: metric(narrow_server.url, "ardit_dit_handoffs_in_flight") == 1)
        answer = post_handoff(narrow_server.url, complete_handoff(hidden_rows(ROWS)))
        assert answer.status == 429
        assert answer.refusal["code"] == "dit_full"
        assert int(answer.headers["retry-after"]) >= 1
        reservation = httpx.post(f"{narrow_server.url}/v1/handoff/reservations", headers=handoff_headers())
        assert reservation.status_code == 429 and reservation.json()["error"]["code"] == "dit_full"
    finally:
        holder.close()
    # A dropped connection ends the handoff like any other failure.
    wait_for(lambda: metric(narrow_server.url, "ardit_dit_handoff_failures_total", reason="client_disconnected") == 1)
    assert_released(narrow_server.url)
    assert post_handoff(narrow_server.url, complete_handoff(hidden_rows(ROWS))).status == 200


def test_a_reserved_place_is_kept_for_the_handoff_that_names_it(narrow_server):
    reserved = httpx.post(f"{narrow_server.url}/v1/handoff/reservations", headers=handoff_headers())
    assert reserved.status_code == 201 and reserved.json()["expires_in"] > 0
    # The one place is held: a handoff without the reservation is refused at once, before its body.
    assert post_handoff(narrow_server.url, complete_handoff(hidden_rows(ROWS))).status == 429
    named = {**handoff_headers(), "x-ardit-reservation": reserved.json()["reservation"]}
    answer = post_handoff(narrow_server.url, complete_handoff(hidden_rows(ROWS)), headers=named)
    assert answer.status == 200 and answer.images


def test_reservations_want_the_handoff_token(narrow_server):
    answer = httpx.post(f"{narrow_server.url}/v1/handoff/reservations")
    assert answer.status_code == 401


def test_unconfigured_token_refuses_every_handoff(tmp_path):
    # No model either: the token check comes first, so this server never needs one.
    server = LiveServer(create_dit_app(DitSettings(model_dir=tmp_path / "missing", handoff_token=None))).start()
    try:
        answer = post_handoff(server.url, complete_handoff(hidden_rows(ROWS)))
    finally:
        server.stop()
    assert answer.status == 503
    assert answer.refusal["code"] == "handoff_auth_not_configured"
