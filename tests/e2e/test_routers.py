"""What routers get from the AR, on real processes: vLLM's KV-cache events over ZMQ, the render
endpoint's token ids (the same ids the events carry), and two AR replicas behind vllm-router.

Two AR replicas (``python -m ar_service``) share the session's DiT. They run without API keys:
vllm-router drops the client's Authorization header (checked below), so keys belong at the router.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from tests.conftest import HANDOFF_TOKEN
from tests.e2e.metrics_text import sample
from tests.support.ports import free_port
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

# More than one CPU block (128 tokens) with the template: at least one full block is stored.
LONG_PROMPT = ", ".join(["a quiet harbour at dawn with fishing boats and gulls"] * 14)


@dataclass
class Replica:
    process: subprocess.Popen[bytes]
    url: str
    kv_events: str | None

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def served(self) -> float:
        try:
            return sample(self.url, "ardit_ar_requests_total", status="ok")
        except KeyError:
            return 0.0


def start_replica(dit_url: str, kv_events: bool) -> Replica:
    port = free_port()
    env = dict(
        os.environ,
        ARDIT_AR_PORT=str(port),
        ARDIT_AR_DIT_URL=dit_url,
        ARDIT_HANDOFF_TOKEN=HANDOFF_TOKEN,
        ARDIT_AR_LOG_LEVEL="WARNING",
    )
    endpoint = None
    if kv_events:
        # The AR binds (as in the Kubernetes manifests, where the router dials each pod).
        kv_port = free_port()
        endpoint = f"tcp://127.0.0.1:{kv_port}"
        env |= {"ARDIT_AR_KV_EVENTS_PUBLISHER": "zmq", "ARDIT_AR_KV_EVENTS_ENDPOINT": f"tcp://*:{kv_port}"}
    process = subprocess.Popen(
        [sys.executable, "-m", "ar_service"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return Replica(process, f"http://127.0.0.1:{port}", endpoint)


@pytest.fixture(scope="module")
def replicas(stack) -> Iterator[tuple[Replica, Replica]]:
    pair = (start_replica(stack.dit.url, kv_events=True), start_replica(stack.dit.url, kv_events=False))
    try:

        def running_and_ready() -> bool:
            assert all(r.process.poll() is None for r in pair), "a replica exited"
            return all(r.ready() for r in pair)

        wait_for(running_and_ready, 900, "both replicas are ready", every=1)
        yield pair
    finally:
        for replica in pair:
            if replica.process.poll() is None:
                replica.process.send_signal(signal.SIGINT)
        for replica in pair:
            replica.process.wait(120)


def generate(url: str, seed: int, **headers: str) -> httpx.Response:
    body = {"prompt": "a yellow square", "size": "64x64", "seed": seed, "num_inference_steps": 2}
    return httpx.post(f"{url}/v1/images/generations", json=body, headers=headers, timeout=300)


def test_kv_events_carry_the_blocks_of_a_requests_prompt_and_render_gives_their_tokens(replicas):
    replica = replicas[0]
    subscriber: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(replica.kv_events)
    time.sleep(1.0)  # a subscriber gets only what is published after it is connected
    try:
        rendered = httpx.post(f"{replica.url}/v1/completions/render", json={"prompt": LONG_PROMPT}).json()
        token_ids = rendered[0]["token_ids"]
        assert generate(replica.url, 1).status_code == 200  # warms the connection, other prompt
        response = httpx.post(
            f"{replica.url}/v1/images/generations",
            timeout=300,
            json={"prompt": LONG_PROMPT, "size": "64x64", "num_inference_steps": 2},
        )
        assert response.status_code == 200
        stored: list[BlockStored] = []
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(e.token_ids == token_ids[:128] for e in stored):
            if subscriber.poll(1000):
                _topic, _seq, payload = subscriber.recv_multipart()
                stored += [e for e in decoder.decode(payload).events if isinstance(e, BlockStored)]
    finally:
        subscriber.close(linger=0)
    [first_block] = [e for e in stored if e.token_ids == token_ids[:128]]
    # One cache group: the hidden-state rows live in the very blocks whose KV these events announce.
    assert first_block.block_size == 128 and first_block.group_idx in (None, 0)
    assert {e.group_idx for e in stored} <= {None, 0}
    print(f"BlockStored: {len(stored)} events, kinds {sorted({str(e.kv_cache_spec_kind) for e in stored})}")


@pytest.fixture(scope="module")
def router(replicas) -> Iterator[str]:
    binary = shutil.which("vllm-router", path=os.path.dirname(sys.executable))
    assert binary, "vllm-router is installed by requirements-dev (make test)"
    port = free_port()
    process = subprocess.Popen(
        [
            binary,
            "--worker-urls",
            *(r.url for r in replicas),
            "--policy",
            "round_robin",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--health-check-interval-secs",
            "2",
            "--health-failure-threshold",
            "1",
            "--worker-startup-check-interval",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def running_and_answering() -> bool:
            assert process.poll() is None, "vllm-router exited"
            try:
                return httpx.get(f"{url}/v1/models", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(running_and_answering, 120, "vllm-router answers", every=0.5)
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(30)


def test_requests_through_vllm_router_reach_both_replicas(router, replicas):
    before = [r.served() for r in replicas]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert all(r.status_code == 200 for r in pool.map(lambda s: generate(router, s), range(8)))
    assert all(r.served() > b for r, b in zip(replicas, before, strict=True))


def test_vllm_router_drops_the_request_id_and_authorization_headers(router, replicas):
    response = generate(router, 40, **{"x-request-id": "trace-through-router", "authorization": "Bearer sk-x"})
    assert response.status_code == 200
    assert response.headers.get("x-request-id") != "trace-through-router"


def test_a_killed_replica_is_dropped_after_the_routers_health_check(router, replicas):
    replicas[1].process.send_signal(signal.SIGKILL)
    replicas[1].process.wait(30)
    killed_at = time.monotonic()
    statuses: list[int] = []
    while time.monotonic() - killed_at < 60:
        statuses.append(generate(router, len(statuses)).status_code)
        if statuses[-4:] == [200] * 4:
            break
    recovered = time.monotonic() - killed_at
    assert statuses[-4:] == [200] * 4, statuses
    print(f"vllm-router: {statuses.count(200)} ok / {len(statuses)} after the kill; steady after {recovered:.1f} s")
