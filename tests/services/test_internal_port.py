"""The internal port: the cluster's own calls with no key, nothing else; the public port unchanged."""

from __future__ import annotations

import asyncio

import httpx
from starlette.types import Receive, Scope, Send

from services.internal_port import InternalPort


def answering(name: str):
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": name.encode()})

    return app


def get(url: str, method: str = "GET") -> httpx.Response:
    app = InternalPort(answering("public"), answering("internal"), port=8002, paths=("/v1/completions/render",))

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
            return await client.request(method, url)

    return asyncio.run(call())


def test_a_listed_path_on_the_internal_port_reaches_the_internal_app():
    assert get("http://ar:8002/v1/completions/render", "POST").text == "internal"


def test_any_other_path_on_the_internal_port_is_a_404_never_the_public_api():
    answer = get("http://ar:8002/v1/images/generations", "POST")
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"


def test_every_other_port_is_the_public_app():
    assert get("http://ar:8000/v1/completions/render", "POST").text == "public"
    assert get("http://ar:8000/v1/images/generations", "POST").text == "public"
