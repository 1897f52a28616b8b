"""Loading the model in the background, warming it up, and saying when the service is ready.

The HTTP server starts at once so /healthz and /readyz answer during a (possibly long) load; /readyz
turns ready only after a render at the smallest size has gone through the whole path (transformer,
VAE, encoder), which also pays one-time costs before real traffic arrives, and timed ones: the
smallest again, and the default request in the fewest steps and in twice as many, four times, ...
until its steps take as long as the rest of it (or the most steps allowed: a model whose VAE
outweighs a few steps, the tiny ones here, needs many for their time to stand out of a busy
machine's noise; a large one stops at the first doubling). They split a render's time into this
DiT's pace (``Pace``): the steps tell the seconds per unit of denoising, the default size then the
seconds per megapixel (the VAE, the encoder), the smallest the seconds every render costs. The AR
prices waits at that pace before it has measured the pair's own (a fresh pair then admits its first
burst by what it costs, instead of refusing all but one round), and splits the pair's measured time
by it after. Once ready, /readyz's body carries what this DiT announces (its capabilities, with that
pace).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import PIL.Image
import torch

from dit_service.conditioning import Conditioning
from dit_service.model import DitModel
from dit_service.render_job import EditInput, RenderItem, RenderJob
from dit_service.renderer import Renderer
from services.app import Readiness
from services.errors import ApiError
from services.fatal import Fatal
from services.heap import freeze_startup_heap
from services.model_card import ModelCard
from shared.capabilities import Load, Pace
from shared.diffusion import DiffusionParams

log = logging.getLogger("ardit.dit.model_state")

Loaded = TypeVar("Loaded")


def warmup_job(model: DitModel, params: DiffusionParams | None = None) -> RenderJob:
    """A render of one row of zeros: at the smallest size in the fewest steps, or as ``params`` say; from one grey
    picture where the family draws from pictures only."""
    facts = model.facts
    size = facts.size_multiple
    params = params or DiffusionParams(
        width=size, height=size, num_inference_steps=facts.min_inference_steps, guidance_scale=0.0, seed=0
    )
    embeds, mask = (
        torch.zeros((1, 1, facts.row_width), dtype=facts.dtype),
        torch.ones((1, 1), dtype=torch.long),
    )
    negative = (embeds, mask) if params.cfg else (None, None)
    conditioning = Conditioning(embeds, mask, *negative)
    return RenderJob(request_id="warmup", conditioning=conditioning, params=params, edit=_warmup_edit(model.card, size))


def _warmup_edit(card: ModelCard, size: int) -> EditInput | None:
    """None where the family draws from text alone; else one grey picture, at the size the AR sends a ``size`` square
    at (a reference edit's pictures come at their ``vae_size``), with a strength where its edits take one."""
    if card.text_to_image:
        return None
    width, height = card.reads_pictures.vae_size(size, size) if card.reads_pictures is not None else (size, size)
    picture = PIL.Image.new("RGB", (width, height), (128, 128, 128))
    return EditInput((picture,), None, 1.0 if card.edit_strength else None)


@dataclass(frozen=True)
class Warmup:
    """What warms the model up: a renderer with throwaway metrics, and the default request and the steps it may
    be rendered in (the renders timed besides the smallest)."""

    renderer: Renderer
    default: DiffusionParams
    fewest_steps: int
    most_steps: int


class ModelState(Generic[Loaded]):
    """``load`` builds the model and what serves it; ``require`` hands that out once warmed up."""

    def __init__(
        self, retry_after_seconds: int, announce: Callable[[Loaded, Pace], Mapping[str, Any]], fatal: Fatal
    ) -> None:
        """``announce``: /readyz's body, from what was loaded and the pace the warm-up measured."""
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
            smallest = warmup_job(model)
            await asyncio.to_thread(_render, warmup.renderer, smallest)
            pace = await _measured_pace(model, warmup, smallest)
        except Exception as exc:
            log.exception("model load failed")
            self._readiness = Readiness(False, f"model load failed ({type(exc).__name__})")
            self._fatal.trigger(f"DiT model load failed ({type(exc).__name__}: {exc})")
            return
        self._loaded = loaded
        freeze_startup_heap()
        self._readiness = Readiness(True, "ready", self._announce(loaded, pace))
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


def _timed(renderer: Renderer, job: RenderJob) -> tuple[float, Load]:
    """The seconds a render of ``job`` took, and its load."""
    started = time.perf_counter()
    _render(renderer, job)
    return time.perf_counter() - started, Load.of(job.params)


async def _measured_pace(model: DitModel, warmup: Warmup, smallest: RenderJob) -> Pace:
    def default_in(steps: int) -> RenderJob:
        return warmup_job(model, warmup.default.model_copy(update={"num_inference_steps": steps}))

    smallest_took = await asyncio.to_thread(_timed, warmup.renderer, smallest)
    fewer_took = await asyncio.to_thread(_timed, warmup.renderer, default_in(warmup.fewest_steps))
    steps = warmup.fewest_steps
    while True:
        steps = min(warmup.most_steps, 2 * steps)
        more_took = await asyncio.to_thread(_timed, warmup.renderer, default_in(steps))
        if steps == warmup.most_steps or more_took[0] >= 2 * fewer_took[0]:
            return split_pace(smallest_took, fewer_took, more_took)


def split_pace(smallest: tuple[float, Load], fewer: tuple[float, Load], more: tuple[float, Load]) -> Pace:
    """The pace of renders that took these (seconds, load): ``fewer`` and ``more`` the same size in fewer and more
    steps, ``smallest`` the smallest. Each part is what is left of the time once the parts after it are paid,
    never below 0: a measurement drowned in a busy machine's noise prices that part at nothing rather than
    less than nothing."""

    def per(seconds: float, amount: float) -> float:
        return max(0.0, seconds / amount) if amount > 0 else 0.0

    (small_s, small), (fewer_s, fewer_load), (more_s, more_load) = smallest, fewer, more
    per_work = per(more_s - fewer_s, more_load.work - fewer_load.work)
    per_megapixel = per(
        fewer_s - small_s - per_work * (fewer_load.work - small.work), fewer_load.megapixels - small.megapixels
    )
    per_request = max(0.0, small_s - per_work * small.work - per_megapixel * small.megapixels)
    return Pace(per_request=per_request, per_megapixel=per_megapixel, per_work=per_work)
