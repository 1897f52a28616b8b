"""Fixtures the end-to-end tests share, and the pair the reference tests start in this process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from openai import OpenAI

from ar_service.app import create_ar_app
from ar_service.settings import ArSettings
from dit_service.app import create_dit_app
from dit_service.conditioning import ConditioningAdapter
from dit_service.settings import DitSettings
from services.dtype import cpu_has_native_bf16
from tests.conftest import API_KEY, HANDOFF_TOKEN, Stack, require_checkpoint
from tests.support.live_server import LiveServer


@pytest.fixture(scope="module")
def client(stack: Stack) -> OpenAI:
    """The official ``openai`` client on the session's pair: its strict response validation checks every answer's
    shape, no retries (one would hide a failure), and a timeout that only a hang reaches."""
    return OpenAI(
        base_url=stack.api_base, api_key=API_KEY, max_retries=0, timeout=300, _strict_response_validation=True
    )


@contextmanager
def pair_on_folder(
    folder: Path, dtype_name: str, wrap_select: Callable[[Any], Any]
) -> Iterator[tuple[OpenAI, LiveServer]]:
    """Both services in this process at their defaults on ``folder`` (a model in its published layout), given that
    folder and nothing else of the model; fp32 named, bf16 this machine's own default where the CPU multiplies it
    natively. The DiT's ``ConditioningAdapter.select`` is ``wrap_select`` of it (what the reference tests record).
    Yields an OpenAI client of the AR and the AR's server (its engine is ``ar.app.state.runtime.engine``)."""
    folder = require_checkpoint(folder)
    dtype = None if dtype_name == "bfloat16" and cpu_has_native_bf16() else dtype_name
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ConditioningAdapter, "select", wrap_select(ConditioningAdapter.select))
        dit_settings = DitSettings(model_dir=folder, handoff_token=HANDOFF_TOKEN, dtype=dtype)
        dit = LiveServer(create_dit_app(dit_settings)).start().wait_ready()
        settings = ArSettings(model_dir=folder, dit_url=dit.url, handoff_token=HANDOFF_TOKEN, dtype=dtype)
        ar = LiveServer(create_ar_app(settings)).start().wait_ready()
        try:
            assert ar.app.state.runtime.engine.dtype == getattr(torch, dtype_name)
            yield OpenAI(base_url=f"{ar.url}/v1", api_key="-", max_retries=0), ar
        finally:
            ar.stop()
            dit.stop()
