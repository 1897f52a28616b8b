"""Lifecycle on real servers: client disconnects, a DiT that dies mid-handoff, concurrency."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from ar_service.handoff_client import HandoffClient
from tests.conftest import API_KEY, HANDOFF_TOKEN, Stack
from tests.e2e.metrics_text import sample
from tests.support.ports import free_port

pytestmark = pytest.mark.slow

HEADERS = {"authorization": f"Bearer {API_KEY}"}


def post(stack: Stack, timeout: float = 300, **body) -> httpx.Response:
    return httpx.post(
        f"{stack.api_base}/images/generations", json={"size": "64x64", **body}, headers=HEADERS, timeout=timeout
    )


def settled(stack: Stack, timeout: float = 30.0) -> dict[str, float]:
    """Wait until nothing is in flight anywhere; return the counters that must be zero."""
    engine = stack.runtime.engine

    def counts() -> dict[str, float]:
        return {
            "ar_requests": sample(stack.ar.url, "ardit_ar_requests_in_flight"),
            "ar_handoffs": sample(stack.ar.url, "ardit_ar_handoffs_in_flight"),
            "row_queues": engine.channel.open_queues,
            "engine_requests": engine.vllm.output_processor.get_num_unfinished_requests(),
            "dit_handoffs": sample(stack.dit.url, "ardit_dit_handoffs_in_flight"),
            "dit_runs": sample(stack.dit.url, "ardit_dit_pipeline_runs_in_flight"),
            "dit_row_buffers": sample(stack.dit.url, "ardit_dit_handoff_buffer_bytes"),
        }

    deadline = time.monotonic() + timeout
    while any(counts().values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return counts()


def test_client_disconnect_aborts_everything(stack):
    with pytest.raises(httpx.ReadTimeout):
        post(stack, timeout=1.5, prompt="a slow one", max_new_tokens=60, num_inference_steps=30)
    assert not any(settled(stack).values())
    assert post(stack, prompt="still serving", num_inference_steps=2).status_code == 200


def test_client_disconnect_during_denoising_stops_the_dit(stack):
    with pytest.raises(httpx.ReadTimeout):
        # Far more denoising than the client waits for, on any machine (tens of seconds here).
        post(stack, timeout=2.0, prompt="long denoise", size="1024x1024", num_inference_steps=100)
    assert not any(settled(stack).values())


def test_dit_dying_mid_handoff_fails_fast_with_503(stack):
    port = free_port()
    env = dict(os.environ, ARDIT_DIT_PORT=str(port), ARDIT_HANDOFF_TOKEN=HANDOFF_TOKEN, ARDIT_DIT_TORCH_THREADS="1")
    doomed = subprocess.Popen(
        [sys.executable, "-m", "dit_service"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    generator = stack.runtime.generator
    healthy = generator.dit
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the second DiT did not start"
            time.sleep(0.2)
        generator.dit = HandoffClient(
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60.0), HANDOFF_TOKEN
        )
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post, stack, prompt="doomed", max_new_tokens=60, num_inference_steps=2)
            while sample(f"http://127.0.0.1:{port}", "ardit_dit_handoffs_in_flight") < 1:
                time.sleep(0.02)
            killed_at = time.monotonic()
            doomed.send_signal(signal.SIGKILL)
            response = pending.result(timeout=60)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "dit_unavailable"
        assert time.monotonic() - killed_at < 10  # failed fast, not after the generation ran out
    finally:
        generator.dit = healthy
        doomed.kill()
        doomed.wait()
    counts = settled(stack)
    assert not any(counts.values()), counts
    assert post(stack, prompt="the engine keeps serving", num_inference_steps=2).status_code == 200


def test_eight_concurrent_requests_match_their_solo_images(stack):
    prompts = [(f"object number {i}", 100 + i) for i in range(8)]
    solo = {
        seed: post(stack, prompt=p, seed=seed, num_inference_steps=2).json()["data"][0]["b64_json"]
        for p, seed in prompts
    }
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda ps: post(stack, prompt=ps[0], seed=ps[1], num_inference_steps=2), prompts))
    for (_, seed), response in zip(prompts, together, strict=True):
        assert response.status_code == 200
        assert response.json()["data"][0]["b64_json"] == solo[seed]
    assert not any(settled(stack).values())


def test_full_queue_is_429_with_retry_after(stack):
    capacity = stack.settings.max_concurrent_requests + stack.settings.max_queued_requests
    with concurrent.futures.ThreadPoolExecutor(capacity + 6) as pool:
        responses = list(
            pool.map(
                lambda i: post(stack, prompt=f"crowd {i}", max_new_tokens=20, num_inference_steps=2),
                range(capacity + 6),
            )
        )
    statuses = [r.status_code for r in responses]
    assert statuses.count(429) >= 1 and set(statuses) <= {200, 429}
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.headers["retry-after"] and refused.json()["error"]["type"] == "rate_limit_error"
    assert not any(settled(stack).values())


def test_error_during_a_stream_arrives_as_an_sse_error_event(stack):
    generator = stack.runtime.generator
    healthy = generator.dit
    nobody = httpx.AsyncClient(base_url=f"http://127.0.0.1:{free_port()}", timeout=10.0)
    generator.dit = HandoffClient(nobody, HANDOFF_TOKEN)
    try:
        response = post(stack, prompt="no dit", stream=True, partial_images=1, num_inference_steps=2)
    finally:
        generator.dit = healthy
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert len(events) == 1
    error = json.loads(events[0])["error"]
    assert error["code"] == "dit_unavailable" and set(error) == {"message", "type", "param", "code"}
    assert not any(settled(stack).values())
