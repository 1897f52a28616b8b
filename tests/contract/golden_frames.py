"""The golden handoffs: small fixed streams whose bytes are committed under golden/.

The test re-encodes these frames and compares byte for byte, so any change to the wire format
shows up as a failing test. One stream per row dtype (text to image, with CFG; float32's and float16's rows are
Qwen-Image's recipe, bfloat16's hold two layers side by side, 2 wide each, read by a chat template as FLUX.2
[klein]'s hold three), one image edit (open.edit with a strength, the picture and mask pixels frames, and a step
cache) and one reference edit (two pictures, each at its own size, no strength). Regenerate only on purpose (a schema
change), with:

    python -m tests.contract.golden_frames --write
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from shared.diffusion import DiffusionParams, FirstBlockCache
from shared.frame_types import Buffer
from shared.frames import EditSpec, OpenFrame, PictureSpec, StreamSpec
from shared.handoff_encoder import HandoffEncoder
from shared.row_recipe import RowRecipe

GOLDEN_DIR = Path(__file__).parent / "golden"
ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HIDDEN = 4
# The recipe of the rows of every golden but bfloat16's: Qwen-Image's, at layer 30.
QWEN_IMAGE_ROWS = RowRecipe(layers=[30])
# bfloat16's: two layers side by side, before the norm, by the tokenizer's chat template (a template of None travels).
TWO_LAYER_ROWS = RowRecipe(
    layers=[14, 28],
    final_norm=False,
    template=None,
    chat_template_kwargs={"enable_thinking": False},
    drops_template=False,
    conditioning="every_row",
)


def golden_rows(dtype: torch.dtype, n: int, offset: int = 0) -> torch.Tensor:
    # Exactly representable values (multiples of 1/8 below 8): identical in every dtype.
    values = (torch.arange(n * HIDDEN, dtype=torch.float32) + offset).remainder(61) / 8 - 3.5
    return values.reshape(n, HIDDEN).to(dtype)


def golden_stream(dtype: torch.dtype) -> list[list[Buffer]]:
    """open, rows (cond, 2 frames), rows (uncond), close — one list of buffers per frame group."""
    open_frame = OpenFrame(
        request_id="req_golden",
        model="smollm2-135m-instruct",
        dtype=dtype_name(dtype),
        row_width=HIDDEN,
        rows=TWO_LAYER_ROWS if dtype == torch.bfloat16 else QWEN_IMAGE_ROWS,
        streams={
            "cond": StreamSpec(prompt_tokens=3, max_rows=4, prefix_tokens=1),
            "uncond": StreamSpec(prompt_tokens=2, max_rows=2, prefix_tokens=1),
        },
        diffusion=DiffusionParams(width=64, height=48, num_inference_steps=4, guidance_scale=4.0, seed=7),
    )
    enc = HandoffEncoder(open_frame)
    cond = golden_rows(dtype, 4)
    uncond = golden_rows(dtype, 2, offset=100)
    return [
        enc.open_frame(),
        enc.rows("cond", 0, [11, 12, 13], cond[:3]),
        enc.rows("cond", 3, [14], cond[3:]),
        enc.rows("uncond", 0, [21, 22], uncond),
        enc.close(
            token_ids={"cond": [11, 12, 13, 14, 15], "uncond": [21, 22, 23]},
            answer_start_index={"cond": 3, "uncond": 2},
            cached_tokens=0,
            cache_creation_tokens=3,
            timings={"ttft": 0.25, "ar_total": 0.5},
        ),
    ]


# The edit golden's picture: 2 x 4 pixels, at the output size.
EDIT_HEIGHT, EDIT_WIDTH = 2, 4
# The reference edit golden's pictures, (width, height) each: the first 4 x 2, the second 2 x 3.
REFERENCE_SIZES = ((4, 2), (2, 3))


def golden_picture(width: int, height: int, step: int = 9) -> bytes:
    """A picture's RGB bytes: 0, step, 2 step, ..."""
    return bytes(range(0, step * height * width * 3, step))


def golden_edit_pixels() -> tuple[bytes, bytes]:
    """The edit golden's picture (RGB, values 0, 9, 18, ...) and mask (the right half repainted)."""
    mask = bytes([0, 0, 255, 255] * EDIT_HEIGHT)
    return golden_picture(EDIT_WIDTH, EDIT_HEIGHT), mask


def edit_open(request_id: str, edit: EditSpec, width: int, height: int, **diffusion: object) -> OpenFrame:
    return OpenFrame(
        request_id=request_id,
        model="smollm2-135m-instruct",
        dtype="float32",
        row_width=HIDDEN,
        rows=QWEN_IMAGE_ROWS,
        streams={"cond": StreamSpec(prompt_tokens=3, max_rows=3, prefix_tokens=1)},
        diffusion=DiffusionParams.model_validate(
            {"width": width, "height": height, "num_inference_steps": 4, "guidance_scale": 1.0, "seed": 7, **diffusion}
        ),
        edit=edit,
    )


def rows_and_close(enc: HandoffEncoder) -> list[list[Buffer]]:
    return [
        enc.rows("cond", 0, [11, 12, 13], golden_rows(torch.float32, 3)),
        enc.close(
            token_ids={"cond": [11, 12, 13, 14]},
            answer_start_index={"cond": 3},
            cached_tokens=0,
            cache_creation_tokens=3,
        ),
    ]


def golden_edit_stream() -> list[list[Buffer]]:
    """open (with an edit of one picture, a strength and a mask), pixels (picture 0, mask), rows (cond), close."""
    edit = EditSpec(pictures=[PictureSpec(width=EDIT_WIDTH, height=EDIT_HEIGHT)], strength=0.5, mask=True)
    step_cache = FirstBlockCache(method="first_block", threshold=0.125)
    enc = HandoffEncoder(edit_open("req_golden_edit", edit, EDIT_WIDTH, EDIT_HEIGHT, step_cache=step_cache))
    picture, mask = golden_edit_pixels()
    return [enc.open_frame(), enc.pixels("image", 0, picture), enc.pixels("mask", 0, mask), *rows_and_close(enc)]


def golden_reference_edit_stream() -> list[list[Buffer]]:
    """open (with a reference edit of two pictures of their own sizes, no strength), pixels (pictures 0 and 1), rows
    (cond), close."""
    edit = EditSpec(pictures=[PictureSpec(width=w, height=h) for w, h in REFERENCE_SIZES])
    enc = HandoffEncoder(edit_open("req_golden_reference_edit", edit, 32, 16))
    pictures = [enc.pixels("image", i, golden_picture(w, h, step=i + 5)) for i, (w, h) in enumerate(REFERENCE_SIZES)]
    return [enc.open_frame(), *pictures, *rows_and_close(enc)]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


GOLDEN_STREAMS: dict[str, Callable[[], list[list[Buffer]]]] = {
    **{dtype_name(dtype): functools.partial(golden_stream, dtype) for dtype in ROW_DTYPES},
    "edit": golden_edit_stream,
    "reference_edit": golden_reference_edit_stream,
}


def golden_bytes(name: str) -> bytes:
    """The golden stream of that name: a row dtype's, ``edit`` or ``reference_edit``."""
    return b"".join(bytes(buf) for group in GOLDEN_STREAMS[name]() for buf in group)


def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"handoff_{name}.msgpack"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="overwrite the committed golden files")
    args = parser.parse_args()
    for name in GOLDEN_STREAMS:
        data = golden_bytes(name)
        if args.write:
            golden_path(name).write_bytes(data)
        print(golden_path(name).name, len(data), "bytes")
