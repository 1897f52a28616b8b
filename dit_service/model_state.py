"""Loading the model in the background, warming it up, and saying when the service is ready.

The HTTP server starts at once so /healthz and /readyz answer during a (possibly long) load;
/readyz turns ready only after a render at the smallest size has gone through the whole path
(transformer, VAE, encoder), which also pays one-time costs before real traffic arrives, and a
second, timed one at the default size and guidance in two steps: its seconds per unit of work are
what the AR prices waits at before it has measured its own (a fresh pair then admits its first
burst by what it costs, instead of refusing all but one round). Once ready, /readyz's body carries
what this DiT announces (its capabilities, with that pace).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from dit_service.conditioning import Conditioning
from dit_service.model import DitModel
from dit_service.render_job import RenderItem, RenderJob
from dit_service.renderer import Renderer
from services.app import Readiness
from services.errors import ApiError
from services.fatal import Fatal
from services.heap import freeze_startup_heap
from shared.diffusion import DiffusionParams

log = logging.getLogger("ardit.dit.model_state")

Loaded = TypeVar("Loaded")


def warmup_job(model: DitModel, params: DiffusionParams | None = None) -> RenderJob:
    """A render of one row of zeros: at the smallest size in the fewest steps, or as ``params`` say."""
    facts = model.facts
    size = facts.size_multiple
    params = params or DiffusionParams(
        width=size, height=size, num_inference_steps=facts.min_inference_steps, guidance_scale=0.0, seed=0
    )
    embeds, mask = (
        torch.zeros((1, 1, facts.joint_attention_dim), dtype=facts.dtype),
        torch.ones((1, 1), dtype=torch.long),
    )
    negative = (embeds, mask) if params.cfg else (None, None)
    return RenderJob(request_id="warmup", conditioning=Conditioning(embeds, mask, *negative), params=params)


@dataclass(frozen=True)
class Warmup:
    """What warms the model up: a renderer with throwaway metrics, and the timed render's parameters."""

    renderer: Renderer
    paced: DiffusionParams


class ModelState(Generic[Loaded]):
    """``load`` builds the model and what serves it; ``require`` hands that out once warmed up."""

    def __init__(
        self, retry_after_seconds: int, announce: Callable[[Loaded, float], Mapping[str, Any]], fatal: Fatal
    ) -> None:
        """``announce``: /readyz's body, from what was loaded and the warm-up's seconds per unit of work."""
        self._retry_after = retry_after_seconds
        self._announce = announce
        self._fatal = fatal
        self._loaded: Loaded | None = None
        self._readiness = Readiness(False, "model not loaded yet")

    async def load(
        self,
        load_model: Callable[[], DitModel],
        serve: Callable[[DitModel], tuple[Loaded, Warmup]],
    ) -> None:
        """``serve`` returns what requests use plus what warms the model up."""
        try:
            self._readiness = Readiness(False, "loading model")
            model = await asyncio.to_thread(load_model)
            loaded, warmup = serve(model)
            self._readiness = Readiness(False, "warming up")
            await asyncio.to_thread(_render, warmup.renderer, warmup_job(model))
            started = time.perf_counter()
            await asyncio.to_thread(_render, warmup.renderer, warmup_job(model, warmup.paced))
            seconds_per_work = (time.perf_counter() - started) / warmup.paced.work
        except Exception as exc:
            log.exception("model load failed")
            self._readiness = Readiness(False, f"model load failed ({type(exc).__name__})")
            self._fatal.trigger(f"DiT model load failed ({type(exc).__name__}: {exc})")
            return
        self._loaded = loaded
        freeze_startup_heap()
        self._readiness = Readiness(True, "ready", self._announce(loaded, seconds_per_work))
        log.info("model ready")

    async def readiness(self) -> Readiness:
        if self._fatal.reason is not None:
            return Readiness(False, f"failed: {self._fatal.reason}")
        return self._readiness

    def require(self) -> Loaded:
        if self._loaded is None or self._fatal.reason is not None:
            raise ApiError(
                503,
                f"the DiT is not ready: {self._readiness.reason}",
                code="model_not_ready",
                headers={"Retry-After": str(self._retry_after)},
            )
        return self._loaded


def _render(renderer: Renderer, job: RenderJob) -> None:
    renderer.render([RenderItem(job, lambda frame: None, threading.Event())])
