"""Tenants at the defaults (the stack has two API keys): a key that floods the queue gets 429 past its share,
and another key's single request, sent after the flood, waits behind that share at most: it takes its turn in line
before most of the flood's requests waiting there."""

from __future__ import annotations

import concurrent.futures
import math
import statistics
import time

import httpx
import pytest

from shared.capabilities import Load
from tests.conftest import API_KEY, OTHER_API_KEY
from tests.e2e.metrics_text import sample
from tests.e2e.test_load import capabilities, servable, stages
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

SIZE, STEPS = "512x512", 20
HANG_GUARD = 900.0


def test_a_flooding_key_cannot_make_another_keys_request_wait_past_its_share(stack):
    share = stack.settings.max_queue_wait_per_key_seconds
    url = f"{stack.api_base}/images/generations"

    def generate(key: str, seed: int) -> httpx.Response:
        body = {"prompt": f"a flood of boats {seed}", "seed": seed, "size": SIZE, "num_inference_steps": STEPS}
        return httpx.post(url, json=body, headers={"authorization": f"Bearer {key}"}, timeout=HANG_GUARD)

    assert generate(API_KEY, 0).status_code == 200  # the pace of these, measured
    load = Load.of(
        capabilities(stack.dit.url)
        .defaults.params()
        .model_copy(update={"width": 512, "height": 512, "num_inference_steps": STEPS})
    )
    each = servable(stack.ar.url, stack.dit.url, SIZE, num_inference_steps=STEPS)[1].seconds(load)
    # Half as much again as the share, within the whole line's wait: without a share, B would wait all of it.
    flood = math.ceil(1.5 * share / each) + 1
    with concurrent.futures.ThreadPoolExecutor(flood + 1) as pool:
        floods = [pool.submit(generate, API_KEY, seed) for seed in range(1, flood + 1)]
        wait_for(
            lambda: sum(f.done() for f in floods) + placed(stack) >= flood,
            HANG_GUARD,
            "every one of A's requests refused or in line",
            every=0.05,
        )
        other = pool.submit(generate, OTHER_API_KEY, 0).result()
        answers = [f.result() for f in floods]
    refused = [a for a in answers if a.status_code == 429]
    print(
        f"key A sent {flood} requests of ~{each:.1f} s ({share:g} s share): {len(answers) - len(refused)} x 200, "
        f"{len(refused)} x 429; key B waited {sum(stages(other)[s] for s in ('queue', 'dit_queue')):.1f} s"
    )
    assert {a.status_code for a in answers} == {200, 429}
    assert all("this API key's requests in line" in a.json()["error"]["message"] for a in refused)
    assert other.status_code == 200
    # The share is seconds at the pace measured before the flood; the flood itself measures how fast the pair
    # really went, and B's wait is held to the share at that pace.
    went = servable(stack.ar.url, stack.dit.url, SIZE, num_inference_steps=STEPS)[1].seconds(load)
    waited = stages(other)
    assert waited["queue"] + waited["dit_queue"] <= share * max(1.0, went / each)


# Small renders: a line forms behind the pair's slots within seconds.
TURN_SIZE, TURN_STEPS = "256x256", 8


def test_another_keys_request_takes_its_turn_before_most_of_a_flooding_keys_requests_in_line(stack):
    """Key A sends as many requests at once as the pair holds in flight and as many again, all within its share;
    once every one is in flight or in line, key B sends one. B's takes the next turn in line: it is answered before
    most of A's requests that were waiting in line when it came, where first come first served answered it after
    all of them."""
    url = f"{stack.api_base}/images/generations"

    def generate(key: str, seed: int) -> tuple[httpx.Response, float, float]:
        """The answer, and when the request was sent and its answer came."""
        body = {
            "prompt": f"boats take turns {seed}",
            "seed": seed,
            "size": TURN_SIZE,
            "num_inference_steps": TURN_STEPS,
        }
        sent = time.monotonic()
        answer = httpx.post(url, json=body, headers={"authorization": f"Bearer {key}"}, timeout=HANG_GUARD)
        return answer, sent, time.monotonic()

    assert generate(API_KEY, 0)[0].status_code == 200  # the pace of these, measured
    capacity = capabilities(stack.dit.url).capacity.max_outstanding
    most = servable(stack.ar.url, stack.dit.url, TURN_SIZE, keyed=True, num_inference_steps=TURN_STEPS)[0]
    flood = min(2 * capacity + 1, most)
    with concurrent.futures.ThreadPoolExecutor(flood + 1) as pool:
        floods = [pool.submit(generate, API_KEY, seed) for seed in range(1, flood + 1)]
        wait_for(
            lambda: sum(f.done() for f in floods) + placed(stack) >= flood,
            HANG_GUARD,
            "every one of A's requests in flight or in line",
        )
        in_line = sample(stack.ar.url, "ardit_ar_requests_queued")
        other, other_sent, other_done = pool.submit(generate, OTHER_API_KEY, 0).result()
        answers = [f.result() for f in floods]
    assert other.status_code == 200 and [a.status_code for a, _, _ in answers] == [200] * flood
    answered_after_b = sum(done > other_done for _, _, done in answers)
    a_median = statistics.median(done - sent for _, sent, done in answers)
    print(
        f"key A sent {flood} requests ({in_line:g} in line), then key B one: B answered in "
        f"{other_done - other_sent:.1f} s, A's median {a_median:.1f} s; {answered_after_b} of A's answered after B"
    )
    assert in_line >= 2 and answered_after_b > in_line / 2


def placed(stack) -> float:
    return sample(stack.ar.url, "ardit_ar_requests_queued") + sample(stack.ar.url, "ardit_ar_requests_in_flight")


def test_a_key_that_fills_the_url_store_evicts_its_own_images_not_another_keys(stack):
    url = f"{stack.api_base}/images/generations"

    def links(key: str, n: int, seed: int) -> list[str]:
        body = {"prompt": "a tiny boat", "size": "64x64", "n": n, "seed": seed, "num_inference_steps": 2}
        answer = httpx.post(
            url, json={**body, "response_format": "url"}, headers={"authorization": f"Bearer {key}"}, timeout=HANG_GUARD
        )
        assert answer.status_code == 200, answer.text
        return [image["url"] for image in answer.json()["data"]]

    [kept] = links(OTHER_API_KEY, 1, 0)
    flood: list[str] = []
    while len(flood) <= stack.settings.image_store_size:  # one key alone puts more than the whole store holds
        flood += links(API_KEY, 10, len(flood))
    assert httpx.get(kept).status_code == 200
    assert httpx.get(flood[0]).status_code == 404  # the flooding key's own oldest went
    assert httpx.get(flood[-1]).status_code == 200
