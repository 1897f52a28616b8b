"""Lifecycle on real servers: client disconnects, a DiT that dies mid-handoff, concurrency."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import socket
import time

import httpx
import pytest

from dit_service.app import create_dit_app
from tests.conftest import API_KEY, Stack, dit_settings
from tests.e2e.metrics_text import sample
from tests.support.dit_pools import pointed_at
from tests.support.live_server import LiveServer
from tests.support.waiting import holds_within, wait_for

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
        channel = engine.channel
        assert channel is not None
        return {
            "ar_requests": sample(stack.ar.url, "ardit_ar_requests_in_flight"),
            "ar_handoffs": sample(stack.ar.url, "ardit_ar_handoffs_in_flight"),
            "row_queues": channel.open_queues,
            "engine_requests": engine.vllm.output_processor.get_num_unfinished_requests(),
            "dit_handoffs": sample(stack.dit.url, "ardit_dit_handoffs_in_flight"),
            "dit_runs": sample(stack.dit.url, "ardit_dit_pipeline_runs_in_flight"),
            "dit_row_buffers": sample(stack.dit.url, "ardit_dit_handoff_buffer_bytes"),
        }

    holds_within(lambda: not any(counts().values()), timeout, every=0.1)  # the callers say what is left
    return counts()


def test_client_disconnect_aborts_everything_and_logs_one_info_line(stack, caplog):
    caplog.set_level(logging.DEBUG)
    # Far more than the client's 1.5 s on any machine: at 64x64 and 30 steps a fast fresh-clone CI runner answered
    # within it, and the client never left.
    with pytest.raises(httpx.ReadTimeout):
        post(stack, timeout=1.5, prompt="a slow one", max_new_tokens=60, size="512x512", num_inference_steps=100)
    assert not any(settled(stack).values())
    said = [r for r in caplog.records if r.name.startswith("ardit") and r.levelno >= logging.INFO]
    leaving = [r for r in said if "client closed the request" in r.getMessage()]
    assert len(leaving) == 1 and leaving[0].levelno == logging.INFO
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or "destroyed" in r.getMessage()]
    assert post(stack, prompt="still serving", num_inference_steps=2).status_code == 200


def test_a_stream_whose_client_leaves_logs_one_info_line(stack, caplog):
    caplog.set_level(logging.DEBUG)
    body = {"prompt": "a slow stream", "stream": True, "partial_images": 2, "num_inference_steps": 30}
    with httpx.stream("POST", f"{stack.api_base}/images/generations", json=body, headers=HEADERS, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the stream started; then the client goes
    assert not any(settled(stack).values())
    leaving = [r for r in caplog.records if "stream was closed before its end" in r.getMessage()]
    assert len(leaving) == 1 and leaving[0].levelno == logging.INFO
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or "destroyed" in r.getMessage()]


def test_client_disconnect_during_denoising_stops_the_dit_within_a_step(stack):
    # Ten images at the largest size the DiT takes, 100 steps each: minutes of work on any machine.
    body = json.dumps({"prompt": "long denoise", "size": "1440x1440", "n": 10, "num_inference_steps": 100}).encode()
    with socket.create_connection(("127.0.0.1", stack.ar.port)) as client:
        client.sendall(
            b"POST /v1/images/generations HTTP/1.1\r\nHost: ar\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_for(
            lambda: sample(stack.dit.url, "ardit_dit_pipeline_runs_in_flight") >= 1,
            120,
            "the render started",
            every=0.05,
        )
        time.sleep(3.0)  # a few denoising steps in (about 1.5 s each here)
    # The client is gone.
    stopped_after = wait_for(
        lambda: not sample(stack.dit.url, "ardit_dit_pipeline_runs_in_flight"), 60, "the run stopped", every=0.05
    )
    # The AR sees the disconnect at once, the DiT at its next write, the run at its next step.
    assert stopped_after < 5.0, stopped_after
    assert not any(settled(stack).values())


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


def test_error_during_a_stream_arrives_as_an_sse_error_event(stack):
    # Ready when the stream starts (the AR probed its DiT a moment ago); gone when the handoff goes out.
    dit = LiveServer(create_dit_app(dit_settings())).start().wait_ready()
    with pointed_at(stack, dit.url) as dits:
        assert stack.ar.call(dits.state()).ready
        dit.stop()
        response = post(stack, prompt="no dit", stream=True, partial_images=1, num_inference_steps=2)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert len(events) == 1
    error = json.loads(events[0])["error"]
    assert error["code"] == "dit_unavailable" and set(error) == {"message", "type", "param", "code"}
    assert not any(settled(stack).values())
