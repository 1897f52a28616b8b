"""64 clients at once against the pair at its default settings: every request is served (the queue
holds them) or refused at once with 429; none is "unavailable"; images equal their solo renders."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from tests.conftest import API_KEY
from tests.e2e.test_lifecycle import settled

pytestmark = pytest.mark.slow

CLIENTS = 64


def generate(stack, seed: int) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = httpx.post(
        f"{stack.api_base}/images/generations",
        json={
            "prompt": f"a small red square number {seed % 8}",
            "size": "64x64",
            "seed": seed,
            "num_inference_steps": 2,
        },
        headers={"authorization": f"Bearer {API_KEY}"},
        timeout=600,
    )
    return response, time.monotonic() - started


def test_sixty_four_at_once_are_all_served_or_refused_at_once(stack):
    solo = {seed: generate(stack, seed)[0].json()["data"][0]["b64_json"] for seed in (1000, 1031, 1063)}
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(lambda i: (1000 + i, *generate(stack, 1000 + i)), range(CLIENTS)))
    statuses = [response.status_code for _, response, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert 503 not in statuses
    for _, response, seconds in results:
        if response.status_code == 429:
            assert seconds < 0.1 and int(response.headers["retry-after"]) >= 1
    served = {
        seed: response.json()["data"][0]["b64_json"] for seed, response, _ in results if response.status_code == 200
    }
    # At the defaults the queue holds all of them (256 places, 120 s of waiting).
    assert len(served) == CLIENTS
    for seed, image in solo.items():
        assert served[seed] == image
    assert not any(settled(stack).values())
