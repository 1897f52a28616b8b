"""Event streams end to end through the official client (strict mode): a refusal known before the
stream starts is an HTTP status the client raises — and retries, after ``Retry-After`` — never an
SSE error inside a 200; a long render that sends no event still sends keep-alive comments."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from openai import OpenAI

from ar_service.admission import AdmissionTicket
from shared.capabilities import Load
from tests.conftest import API_KEY, Stack
from tests.support.dit_pools import pointed_at
from tests.support.ports import free_port

pytestmark = pytest.mark.slow

FAST = {"num_inference_steps": 2}


def client_for(stack: Stack, max_retries: int = 0, http_client: httpx.Client | None = None) -> OpenAI:
    return OpenAI(
        base_url=stack.api_base,
        api_key=API_KEY,
        max_retries=max_retries,
        timeout=300,
        # openai accepts an httpx.Client as well as its own httpx2.Client, but annotates only the latter.
        http_client=http_client,  # type: ignore[arg-type]
        _strict_response_validation=True,
    )


def stream(client: OpenAI) -> list:
    return list(client.images.generate(prompt="a kite", size="64x64", stream=True, extra_body={"seed": 1, **FAST}))


def hold_every_slot(stack: Stack) -> list[AdmissionTicket]:
    """Take every place the pair has, as requests in flight would."""
    dits, capacity = stack.ar.call(stack.runtime.readiness.require())

    async def slot() -> AdmissionTicket:
        return await stack.runtime.admission.enter(capacity, Load.of(dits.defaults.params())).turn()

    return [stack.ar.call(slot()) for _ in range(capacity)]


def release(stack: Stack, tickets: list[AdmissionTicket]) -> None:
    for ticket in tickets:
        stack.ar.loop.call_soon_threadsafe(ticket.release, False)  # held, not served: no pace measured


@pytest.fixture
def full_pair(stack, monkeypatch):
    """Every slot held and no room to wait: the next request is refused with 429 at once."""
    monkeypatch.setattr(stack.runtime.admission, "_max_queued", 0)
    tickets = hold_every_slot(stack)
    yield tickets
    release(stack, tickets)


def test_a_full_queue_refuses_a_stream_with_a_429_the_client_raises(stack, full_pair):
    with pytest.raises(openai.RateLimitError) as info:  # refused, not queued: a queued request is served
        stream(client_for(stack))
    error_body = info.value.body
    assert isinstance(error_body, dict)
    assert info.value.status_code == 429 and error_body["code"] == "rate_limit_exceeded"
    assert int(info.value.response.headers["retry-after"]) >= 1


def test_the_client_retries_a_refused_stream_after_retry_after(stack, full_pair):
    answers: list[httpx.Response] = []
    http = httpx.Client(event_hooks={"response": [answers.append]})
    # Room comes back half a second in: sooner than Retry-After, so only its wait is measured.
    threading.Timer(0.5, release, (stack, full_pair)).start()
    started = time.monotonic()
    events = stream(client_for(stack, max_retries=2, http_client=http))
    waited = time.monotonic() - started
    assert [a.status_code for a in answers] == [429, 200]
    assert waited >= int(answers[0].headers["retry-after"])  # the client's own first backoff is 0.5 s
    assert events[-1].type == "image_generation.completed"


def test_a_dit_that_is_not_ready_refuses_a_stream_with_a_503(stack):
    with (
        pointed_at(stack, f"http://127.0.0.1:{free_port()}"),
        pytest.raises(openai.InternalServerError) as info,
    ):
        stream(client_for(stack))
    error_body = info.value.body
    assert isinstance(error_body, dict)
    assert info.value.status_code == 503 and error_body["code"] == "not_ready"
    assert int(info.value.response.headers["retry-after"]) >= 1


def test_invalid_parameters_refuse_a_stream_with_a_400(stack):
    with pytest.raises(openai.BadRequestError) as info:
        client_for(stack).images.generate(prompt="x", size="100x100", stream=True)
    error_body = info.value.body
    assert isinstance(error_body, dict)
    assert error_body["param"] == "size"


def test_a_prompt_over_a_token_limit_refuses_a_stream_with_a_400(stack):
    dit, _ = stack.ar.call(stack.runtime.readiness.require())
    # Past the image model's conditioning rows (within the AR's own limit), and past the AR's limit.
    for words in (dit.limits.max_conditioning_rows + 8, stack.settings.max_prompt_tokens + 8):
        with pytest.raises(openai.BadRequestError) as info:
            client_for(stack).images.generate(prompt="red " * words, size="64x64", stream=True)
        error_body = info.value.body
        assert isinstance(error_body, dict)
        assert (error_body["param"], error_body["code"]) == ("prompt", "context_length_exceeded"), words
