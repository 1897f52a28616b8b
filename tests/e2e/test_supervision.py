"""Faults recovered without a human, on `make run`'s own launcher and real processes.

One launcher runs the pair at its default settings for the whole module; each test breaks one
thing and checks the statuses on the way, how long recovery took, and that a normal request is
served afterwards with nothing left in flight.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from ar_service.settings import ArSettings
from shared.capabilities import DitCapabilities
from tests.conftest import PLUMBING_DIT_MODEL_DIR
from tests.e2e.metrics_text import sample
from tests.support.launched_pair import READY_TIMEOUT, Pair, launched_pair, ready, wait_for

pytestmark = pytest.mark.slow


def nothing_in_flight(pair: Pair) -> bool:
    return not any(
        (
            sample(pair.ar_url, "ardit_ar_requests_in_flight"),
            sample(pair.ar_url, "ardit_ar_handoffs_in_flight"),
            sample(pair.dit_url, "ardit_dit_handoffs_in_flight"),
            sample(pair.dit_url, "ardit_dit_pipeline_runs_in_flight"),
        )
    )


def error_code(response: httpx.Response) -> str | None:
    """The OpenAI-shaped error's code; None for any other body (an image, a plain-text 500)."""
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Iterator[Pair]:
    """The pair as ``make run`` starts it (the launcher in a process of its own), for the whole module."""
    with launched_pair(tmp_path_factory.mktemp("launcher") / "launcher.log", PLUMBING_DIT_MODEL_DIR) as pair:
        yield pair


def test_a_frozen_dit_fails_requests_in_seconds_and_serves_again_when_thawed(launched):
    dit = launched.service("dit_service")
    dit.suspend()  # SIGSTOP
    try:
        started = time.monotonic()
        response = launched.generate()
        failed_after = time.monotonic() - started
    finally:
        dit.resume()  # SIGCONT
    assert response.status_code == 503, response.text
    # Ended by the DiT's silence (its readiness probe times out, or the request's stall deadline), not left to
    # wait for the whole exchange's deadline.
    assert failed_after < ArSettings().dit_timeout_seconds
    thawed = wait_for(lambda: ready(launched.ar_url), 30, "ready after SIGCONT")
    assert launched.generate().status_code == 200
    wait_for(lambda: nothing_in_flight(launched), 10, "nothing in flight")
    print(f"DiT frozen: the request failed after {failed_after:.1f} s; ready {thawed:.1f} s after SIGCONT")


def test_a_dit_killed_mid_render_is_restarted_and_the_ar_serves_again_without_a_restart(launched):
    ar_pid, dit = launched.service("ar_service").pid, launched.service("dit_service")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # Far more denoising than the kill takes to arrive.
        pending = pool.submit(launched.generate, 300.0, size="512x512", num_inference_steps=100)
        wait_for(lambda: sample(launched.dit_url, "ardit_dit_pipeline_runs_in_flight") == 1, 60, "the render started")
        dit.send_signal(signal.SIGKILL)
        in_flight = pending.result(60)
    assert in_flight.status_code == 503  # not left waiting for its whole exchange's deadline (pending.result's guard)
    meanwhile = launched.generate()
    assert meanwhile.status_code == 503 and meanwhile.json()["error"]["code"] == "not_ready"
    recovered = wait_for(lambda: ready(launched.ar_url), 120, "ready again after the DiT restart")
    assert launched.service("dit_service").pid != dit.pid and launched.service("ar_service").pid == ar_pid
    assert launched.generate().status_code == 200
    wait_for(lambda: nothing_in_flight(launched), 10, "nothing in flight")
    print(f"DiT killed mid-render: the pair was ready again {recovered:.1f} s later")


def test_a_dead_engine_fails_every_request_in_flight_with_503_and_the_ar_comes_back(launched):
    ar = launched.service("ar_service")
    [core] = [p for p in ar.children(recursive=True) if "EngineCore" in p.name() + " ".join(p.cmdline())]
    capacity = DitCapabilities.model_validate(
        httpx.get(f"{launched.dit_url}/readyz").json()["capabilities"]
    ).capacity.max_outstanding
    with concurrent.futures.ThreadPoolExecutor(capacity + 2) as pool:
        # Stages at the kill: one denoising at the DiT (the engine is done with it), one decoding in the
        # engine with its rows streaming to the DiT, the rest of the capacity waiting at the DiT, and
        # two queued at the AR's admission. The render is a long one (1024x1024, 100 steps: tens of seconds on two
        # cores), so that it cannot finish in the second the others take to reach their stages.
        denoising = pool.submit(launched.generate, 300.0, size="1024x1024", num_inference_steps=100)
        wait_for(lambda: sample(launched.dit_url, "ardit_dit_pipeline_runs_in_flight") == 1, 60, "one is denoising")
        decoding = pool.submit(launched.generate, 300.0, max_new_tokens=200)
        wait_for(lambda: sample(launched.ar_url, "ardit_ar_handoffs_in_flight") == 2, 60, "one is decoding")
        rest = [pool.submit(launched.generate, 300.0) for _ in range(capacity)]
        wait_for(lambda: sample(launched.ar_url, "ardit_ar_requests_queued") == 2, 60, "two are queued")
        assert sample(launched.dit_url, "ardit_dit_pipeline_runs_in_flight") == 1, "the render ended before the kill"
        core.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        noticed = wait_for(lambda: not ready(launched.ar_url), 10, "readiness turns 503")
        answers = [pending.result(60) for pending in [denoising, decoding, *rest]]
    answered = time.monotonic() - killed_at
    assert [(a.status_code, error_code(a)) for a in answers] == [(503, "engine_unavailable")] * len(answers), [
        a.text[:300] for a in answers
    ]
    ar.wait(60)  # the AR exits on its own, non-zero (the launcher, its parent, logs the code)...
    wait_for(lambda: "ar exited with code 3" in launched.log.read_text(), 10, "the launcher saw the AR exit with 3")
    back = wait_for(lambda: ready(launched.ar_url), READY_TIMEOUT, "the restarted AR is ready")  # ...and is restarted
    assert launched.service("ar_service").pid != ar.pid
    assert launched.generate().status_code == 200
    wait_for(lambda: nothing_in_flight(launched), 10, "nothing in flight")
    print(
        f"EngineCore killed with {len(answers)} requests in flight: readiness 503 after {noticed:.2f} s, all "
        f"answered 503 within {answered:.1f} s, ready again {time.monotonic() - killed_at:.1f} s after the kill "
        f"({back:.1f} s after the AR exited)"
    )


def test_services_do_not_outlive_a_killed_launcher(launched):
    services = [launched.service("ar_service"), launched.service("dit_service")]
    everything = services + [c for s in services for c in s.children(recursive=True)]
    launched.launcher.send_signal(signal.SIGKILL)
    launched.launcher.wait(10)
    _, alive = psutil.wait_procs(everything, timeout=60)
    assert not alive, [p.pid for p in alive]


def test_stopping_the_launcher_drains_the_pair_as_stopping_the_ar_does(tmp_path):
    """SIGTERM to `make run`'s launcher: admitted work may finish within the drain period, a stream ends with its
    last image or, unfinished at the drain's end, with an ``error`` event (never cut off without one), new requests
    get 503 while the pair drains, and the launcher exits 0. A drain period of 3 s here stands for the default
    150 s, so that a long render is likely to outlast it."""
    drain = {"ARDIT_AR_DRAIN_SECONDS": "3", "ARDIT_DIT_DRAIN_SECONDS": "3"}
    with launched_pair(tmp_path / "launcher.log", PLUMBING_DIT_MODEL_DIR, drain) as pair:
        body = {"prompt": "a long one", "size": "1024x1024", "n": 4, "num_inference_steps": 100, "stream": True}
        with httpx.stream("POST", f"{pair.ar_url}/v1/images/generations", json=body, timeout=120) as stream:
            assert stream.status_code == 200
            wait_for(lambda: sample(pair.dit_url, "ardit_dit_pipeline_runs_in_flight") == 1, 60, "it renders")
            pair.launcher.send_signal(signal.SIGTERM)
            meanwhile = wait_for_answer(lambda: pair.generate(timeout=30))
            events = [line for line in stream.iter_lines() if line.startswith("event:")]
        assert pair.launcher.wait(60) == 0
    assert meanwhile.status_code == 503 and error_code(meanwhile) == "shutting_down"
    assert events[-1] in {"event: error", "event: image_generation.completed"}
    log = pair.log.read_text()
    assert "crashed" not in log and "exited with code" not in log


def wait_for_answer(ask) -> httpx.Response:
    """The first answer to ``ask`` that is not a refused connection (the drain starts as the signal lands)."""
    answers: list[httpx.Response] = []

    def answered() -> bool:
        try:
            answers.append(ask())
        except httpx.TransportError:
            return False
        return True

    wait_for(answered, 30, "an answer while draining")
    return answers[0]
