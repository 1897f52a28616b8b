"""A request's step cache: diffusers' hook on for that request's pipeline calls only, reused passes
counted, and nothing left on the shared transformer however the run ends; with CFG, several images,
previews, edits and batches."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry

from dit_service.metrics import DitMetrics
from dit_service.render_job import EditInput, RenderCancelled, RenderItem, RenderJob
from dit_service.renderer import Renderer
from shared.diffusion import FirstBlockCache, StepCache, TaylorSeerCache
from shared.result_frames import ImageFrame, PartialImageFrame, ProgressFrame, ResultFrame
from tests.dit_service.handoff_requests import params
from tests.dit_service.test_renderer import conditioning, edit_image, edit_mask, renderer_of

pytestmark = pytest.mark.slow

# Loose enough that the tiny random model reuses most passes, so every test sees the hook act.
CACHES: dict[str, StepCache] = {
    "first_block": FirstBlockCache(method="first_block", threshold=1.0),
    "taylorseer": TaylorSeerCache(method="taylorseer", interval=2),
}
STEPS = 8


@pytest.fixture
def metrics() -> DitMetrics:
    return DitMetrics(CollectorRegistry())


@pytest.fixture
def renderer(tiny_model, metrics) -> Renderer:
    return renderer_of(tiny_model, metrics)


def passes(metrics: DitMetrics, method: str, outcome: str) -> float:
    return metrics.step_cache_passes.labels(method, outcome)._value.get()


def job(cache: StepCache | None, name: str = "r", **overrides) -> RenderJob:
    values = {"num_inference_steps": STEPS, "seed": 5, "step_cache": cache, **overrides}
    return RenderJob(name, conditioning(negative=True), params(**values))


def frames_of(renderer: Renderer, render_job: RenderJob, cancel: threading.Event | None = None) -> list[ResultFrame]:
    frames: list[ResultFrame] = []
    renderer.render([RenderItem(render_job, frames.append, cancel or threading.Event())])
    return [f for f in frames if not isinstance(f, ProgressFrame)]


def images(frames: list[ResultFrame]) -> list[bytes]:
    return [f.data for f in frames if isinstance(f, ImageFrame)]


@pytest.mark.parametrize("method", CACHES)
def test_a_step_cache_reuses_passes_and_changes_the_picture_only_for_its_own_request(renderer, metrics, method):
    uncached = images(frames_of(renderer, job(None)))
    cached = images(frames_of(renderer, job(CACHES[method])))
    assert passes(metrics, method, "reused") > 0
    assert passes(metrics, method, "computed") > 0
    assert passes(metrics, method, "reused") + passes(metrics, method, "computed") == STEPS  # no CFG: a pass a step
    assert cached != uncached
    assert not renderer.model.transformer.is_cache_enabled
    assert images(frames_of(renderer, job(None))) == uncached


def test_with_cfg_each_step_is_two_passes(renderer, metrics):
    frames_of(renderer, job(CACHES["first_block"], guidance_scale=3.0))
    total = passes(metrics, "first_block", "reused") + passes(metrics, "first_block", "computed")
    assert total == 2 * STEPS


def test_a_cancelled_cached_run_leaves_no_hook_and_the_next_render_is_uncached(renderer):
    uncached = images(frames_of(renderer, job(None)))
    cancel = threading.Event()
    steps_seen = []

    def emit(frame: ResultFrame) -> None:
        if isinstance(frame, ProgressFrame):
            steps_seen.append(frame.step)
            if frame.step == 3:
                cancel.set()

    [outcome] = renderer.render([RenderItem(job(CACHES["first_block"]), emit, cancel)])
    assert isinstance(outcome, RenderCancelled)
    assert max(steps_seen) < STEPS
    assert not renderer.model.transformer.is_cache_enabled
    assert images(frames_of(renderer, job(None))) == uncached


def test_a_failing_cached_run_leaves_no_hook(renderer):
    def emit(frame: ResultFrame) -> None:
        raise RuntimeError("the consumer broke")

    with pytest.raises(RuntimeError):
        renderer.render([RenderItem(job(CACHES["taylorseer"]), emit, threading.Event())])
    assert not renderer.model.transformer.is_cache_enabled


@pytest.mark.parametrize("method", CACHES)
def test_several_images_with_previews_each_come_with_the_cache_on(renderer, metrics, method):
    frames = frames_of(renderer, job(CACHES[method], num_images=2, partial_images=2))
    assert len(images(frames)) == 2
    assert len([f for f in frames if isinstance(f, PartialImageFrame)]) == 4
    assert passes(metrics, method, "reused") > 0


@pytest.mark.parametrize("masked", [False, True], ids=["img2img", "inpaint"])
def test_an_edit_runs_with_a_step_cache(renderer, metrics, masked):
    edit = EditInput((edit_image(),), edit_mask() if masked else None, 1.0)
    values = {"num_inference_steps": STEPS, "seed": 13, "step_cache": CACHES["first_block"]}
    [frame] = frames_of(renderer, RenderJob("r", conditioning(), params(**values), edit))
    assert isinstance(frame, ImageFrame)
    assert passes(metrics, "first_block", "reused") > 0


def test_jobs_batch_only_with_the_same_step_cache_and_a_batch_runs_it(renderer, metrics):
    cached = [job(CACHES["first_block"], name=f"c{i}", guidance_scale=0.0) for i in range(2)]
    uncached = job(None, name="u", guidance_scale=0.0)
    assert cached[0].batch_key == cached[1].batch_key != uncached.batch_key
    items = [RenderItem(j, lambda frame: None, threading.Event()) for j in cached]
    outcomes = renderer.render(items)
    assert not any(isinstance(o, RenderCancelled) for o in outcomes)
    # One pipeline call for both: a pass a step, counted once.
    assert passes(metrics, "first_block", "reused") + passes(metrics, "first_block", "computed") == STEPS
