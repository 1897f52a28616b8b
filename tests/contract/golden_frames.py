"""The golden handoff: a small fixed stream whose bytes are committed under golden/.

The test re-encodes these frames and compares byte for byte, so any change to the wire format
shows up as a failing test. One stream per row dtype (text to image, with CFG; bfloat16's rows hold two layers
side by side, 2 wide each, as FLUX.2 [klein]'s hold three), and one image edit (open.edit, the image and mask
pixels frames, and a step cache). Regenerate only on purpose (a schema change), with:

    python -m tests.contract.golden_frames --write
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from shared.diffusion import DiffusionParams, FirstBlockCache
from shared.frame_types import Buffer
from shared.frames import EditSpec, OpenFrame, StreamSpec
from shared.handoff_encoder import HandoffEncoder

GOLDEN_DIR = Path(__file__).parent / "golden"
HIDDEN = 4


def golden_rows(dtype: torch.dtype, n: int, offset: int = 0) -> torch.Tensor:
    # Exactly representable values (multiples of 1/8 below 8): identical in every dtype.
    values = (torch.arange(n * HIDDEN, dtype=torch.float32) + offset).remainder(61) / 8 - 3.5
    return values.reshape(n, HIDDEN).to(dtype)


def golden_stream(dtype: torch.dtype) -> list[list[Buffer]]:
    """open, rows (cond, 2 frames), rows (uncond), close — one list of buffers per frame group."""
    wire = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    layers = [14, 28] if dtype == torch.bfloat16 else [30]
    open_frame = OpenFrame(
        request_id="req_golden",
        model="smollm2-135m-instruct",
        conditioning="qwen_image",
        dtype=wire,
        row_width=HIDDEN,
        layers=layers,
        final_norm=len(layers) == 1,
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


# The edit golden's image: 2 x 4 pixels.
EDIT_HEIGHT, EDIT_WIDTH = 2, 4


def golden_edit_pixels() -> tuple[bytes, bytes]:
    """The edit golden's image (RGB, values 0, 9, 18, ...) and mask (the right half repainted)."""
    image = bytes(range(0, 9 * EDIT_HEIGHT * EDIT_WIDTH * 3, 9))
    mask = bytes([0, 0, 255, 255] * EDIT_HEIGHT)
    return image, mask


def golden_edit_stream() -> list[list[Buffer]]:
    """open (with edit), pixels (image, mask), rows (cond), close."""
    open_frame = OpenFrame(
        request_id="req_golden_edit",
        model="smollm2-135m-instruct",
        conditioning="qwen_image",
        dtype="float32",
        row_width=HIDDEN,
        layers=[30],
        final_norm=True,
        streams={"cond": StreamSpec(prompt_tokens=3, max_rows=3, prefix_tokens=1)},
        diffusion=DiffusionParams(
            width=EDIT_WIDTH,
            height=EDIT_HEIGHT,
            num_inference_steps=4,
            guidance_scale=1.0,
            seed=7,
            step_cache=FirstBlockCache(method="first_block", threshold=0.125),
        ),
        edit=EditSpec(strength=0.5, mask=True),
    )
    enc = HandoffEncoder(open_frame)
    image, mask = golden_edit_pixels()
    return [
        enc.open_frame(),
        enc.pixels("image", image),
        enc.pixels("mask", mask),
        enc.rows("cond", 0, [11, 12, 13], golden_rows(torch.float32, 3)),
        enc.close(
            token_ids={"cond": [11, 12, 13, 14]},
            answer_start_index={"cond": 3},
            cached_tokens=0,
            cache_creation_tokens=3,
        ),
    ]


def golden_bytes(dtype: torch.dtype | None) -> bytes:
    """A row dtype's stream, or (None) the edit's."""
    stream = golden_edit_stream() if dtype is None else golden_stream(dtype)
    return b"".join(bytes(buf) for group in stream for buf in group)


def golden_path(dtype: torch.dtype | None) -> Path:
    name = "edit" if dtype is None else str(dtype).removeprefix("torch.")
    return GOLDEN_DIR / f"handoff_{name}.msgpack"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="overwrite the committed golden files")
    args = parser.parse_args()
    for dtype in (torch.bfloat16, torch.float16, torch.float32, None):
        data = golden_bytes(dtype)
        if args.write:
            golden_path(dtype).write_bytes(data)
        print(golden_path(dtype).name, len(data), "bytes")
