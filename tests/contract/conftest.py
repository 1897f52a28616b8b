from __future__ import annotations

import msgpack
import pytest
import torch

from shared.diffusion import DiffusionParams
from shared.frames import OpenFrame, StreamName, StreamSpec
from shared.handoff_encoder import HandoffEncoder
from shared.row_recipe import RowRecipe


def make_open(
    dtype: str = "bfloat16", hidden: int = 8, max_rows: int = 10, prompt: int = 6, uncond: bool = False
) -> OpenFrame:
    streams: dict[StreamName, StreamSpec] = {"cond": StreamSpec(prompt_tokens=prompt, max_rows=max_rows)}
    if uncond:
        streams["uncond"] = StreamSpec(prompt_tokens=prompt, max_rows=max_rows)
    return OpenFrame(
        request_id="req_test",
        model="test-model",
        dtype=dtype,
        row_width=hidden,
        rows=RowRecipe(layers=[30]),
        streams=streams,
        diffusion=DiffusionParams(width=64, height=64, num_inference_steps=2, guidance_scale=1.0, seed=0),
    )


def join(buffers) -> bytes:
    return b"".join(bytes(b) for b in buffers)


def raw(frame: dict) -> bytes:
    """A hand-made frame, for shapes the typed encoder refuses to produce."""
    return msgpack.packb(frame, use_bin_type=True)


@pytest.fixture
def encoder() -> HandoffEncoder:
    return HandoffEncoder(make_open())


@pytest.fixture
def rows() -> torch.Tensor:
    return torch.randn(7, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
