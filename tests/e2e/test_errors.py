"""Every error of the public API: OpenAI's body shape and status, and the client's exception."""

from __future__ import annotations

import socket

import httpx
import openai
import pytest
from openai import OpenAI

from tests.conftest import API_KEY
from tests.support.dit_pools import pointed_at
from tests.support.ports import free_port

pytestmark = pytest.mark.slow


def error_body(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"prompt": "x", "size": "100x100"}, "size"),
        ({"prompt": "x", "size": "big"}, "size"),
        ({"prompt": "x", "n": 11}, "n"),
        ({"prompt": ""}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "background": "transparent"}, "background"),
        ({"prompt": "x", "output_format": "gif"}, "output_format"),
        ({"prompt": "x", "partial_images": 4}, "partial_images"),
        ({"prompt": "x", "num_inference_steps": 1}, "num_inference_steps"),
        ({"prompt": "x", "max_new_tokens": 10_000}, "max_new_tokens"),
        ({"prompt": "x", "unknown_field": 1}, "unknown_field"),
        ({"prompt": "word " * 2000}, "prompt"),
        ({"prompt": "x", "size": "\u00b256x256"}, "size"),
        ({"prompt": "x", "size": "1" * 4301 + "x16"}, "size"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "seed": True}, "seed"),
    ],
)
def test_invalid_requests_are_400_naming_the_param(stack, payload, param):
    response = httpx.post(
        f"{stack.api_base}/images/generations",
        json=payload,
        headers={"authorization": f"Bearer {API_KEY}"},
        timeout=120,
    )
    assert response.status_code == 400, response.text
    error = error_body(response)
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(prompt="x", size="100x100")
    refusal = info.value.body
    assert isinstance(refusal, dict)
    assert refusal["param"] == "size"


def test_bad_key_is_401(stack):
    bad = OpenAI(base_url=stack.api_base, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.images.generate(prompt="x", size="64x64")
    refusal = info.value.body
    assert isinstance(refusal, dict)
    assert refusal["code"] == "invalid_api_key"


def test_missing_key_is_401(stack):
    response = httpx.post(f"{stack.api_base}/images/generations", json={"prompt": "x"})
    assert response.status_code == 401
    error = error_body(response)
    assert error["type"] == "authentication_error" and error["code"] == "missing_api_key"


def test_unknown_model_is_404(client, stack):
    with pytest.raises(openai.NotFoundError) as info:
        client.images.generate(model="gpt-image-9", prompt="x", size="64x64")
    refusal = info.value.body
    assert isinstance(refusal, dict)
    assert refusal["code"] == "model_not_found"


def test_admin_reset_requires_the_admin_token(stack):
    from tests.conftest import ADMIN_TOKEN

    assert httpx.post(f"{stack.ar.url}/admin/reset_prefix_cache").status_code == 401
    ok = httpx.post(f"{stack.ar.url}/admin/reset_prefix_cache", headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert ok.status_code == 200 and "reset" in ok.json()


def test_health_on_both_and_503_while_the_dit_is_not_ready(stack, client):
    for url in (stack.ar.url, stack.dit.url):
        assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}
        assert httpx.get(f"{url}/readyz").status_code == 200
    # A DiT nobody listens for: the AR's probe finds it unreachable.
    with pointed_at(stack, f"http://127.0.0.1:{free_port()}"):
        body = httpx.get(f"{stack.ar.url}/readyz")
        assert body.status_code == 503 and "unreachable" in body.json()["reason"]
        with pytest.raises(openai.InternalServerError) as info:
            client.images.generate(prompt="x", size="64x64", extra_body={"num_inference_steps": 2})
        refusal = info.value.body
        assert isinstance(refusal, dict)
        assert info.value.status_code == 503 and refusal["code"] == "not_ready"
    assert httpx.get(f"{stack.ar.url}/readyz").status_code == 200


def test_the_dit_announces_its_limits_and_the_ar_checks_requests_against_them(stack):
    capabilities = httpx.get(f"{stack.dit.url}/readyz").json()["capabilities"]
    limits = capabilities["limits"]
    assert capabilities["hidden_size"] == 576 and limits["size_multiple"] == 16
    # One step under the DiT's fewest: refused by the AR with the public name, before any work.
    response = httpx.post(
        f"{stack.api_base}/images/generations",
        headers={"authorization": f"Bearer {API_KEY}"},
        json={"prompt": "x", "size": "64x64", "num_inference_steps": limits["min_inference_steps"] - 1},
    )
    assert response.status_code == 400 and error_body(response)["param"] == "num_inference_steps"


def test_bad_input_before_any_work_is_never_a_500(stack):
    # Not ASCII in the key: a 401 on every route, the admin one included.
    for method, path in (
        ("POST", "/v1/images/generations"),
        ("GET", "/v1/models"),
        ("POST", "/admin/reset_prefix_cache"),
    ):
        with socket.create_connection(("127.0.0.1", stack.ar.port)) as sock:
            sock.sendall(
                f"{method} {path} HTTP/1.1\r\nHost: ar\r\nContent-Length: 0\r\n".encode()
                + b"Authorization: Bearer \xc3\xa9\r\n\r\n"
            )
            assert sock.recv(100).startswith(b"HTTP/1.1 401"), path
    # A 50 MB body: refused from its Content-Length, before a byte of it is read (a server waiting for the body
    # would answer 408 at its body deadline, none being sent).
    with socket.create_connection(("127.0.0.1", stack.ar.port)) as sock:
        sock.settimeout(60)  # a hang guard
        sock.sendall(
            f"POST /v1/images/generations HTTP/1.1\r\nHost: ar\r\nAuthorization: Bearer {API_KEY}\r\n".encode()
            + f"Content-Type: application/json\r\nContent-Length: {50 << 20}\r\n\r\n".encode()
        )
        answer = b""
        while b"request_too_large" not in answer and (chunk := sock.recv(4096)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer


def test_a_refusal_known_before_the_stream_starts_is_an_http_status(stack):
    response = httpx.post(
        f"{stack.api_base}/images/generations",
        headers={"authorization": f"Bearer {API_KEY}"},
        json={"prompt": "x", "size": "100x100", "stream": True},
    )
    assert response.status_code == 400 and error_body(response)["param"] == "size"
