"""Every answer of an app made by create_app is OpenAI-shaped JSON that says what went wrong in the
client's terms: a body that is not JSON, a method the route does not take, a bug nobody foresaw."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException

from tests.support.bare_app import Body, bare_app
from tests.support.live_server import LiveServer


def build_app() -> tuple[FastAPI, CollectorRegistry]:
    app, registry = bare_app()

    @app.post("/v1/things")
    async def make(body: Body) -> dict[str, int]:
        return {"n": body.n}

    @app.get("/v1/broken")
    async def broken() -> None:
        raise RuntimeError("a bug")

    @app.get("/v1/refused-by-the-framework")
    async def refused() -> None:
        raise StarletteHTTPException(400, "There was an error parsing the body")

    @app.get("/v1/broken-midway")
    async def broken_midway() -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"first"
            raise RuntimeError("a bug after the status line")

        return StreamingResponse(chunks())

    return app, registry


def test_a_body_that_is_not_json_says_where_it_broke(client_and_registry):
    client, _ = client_and_registry
    response = client.post("/v1/things", content=b'{"n": 1', headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_json" and error["param"] is None
    assert "not valid JSON" in error["message"] and "at character 7" in error["message"]


@pytest.mark.parametrize("content_type", [None, "text/plain"])
def test_a_json_body_sent_without_jsons_content_type_is_a_400_naming_the_header(client_and_registry, content_type):
    client, _ = client_and_registry
    headers = {} if content_type is None else {"content-type": content_type}
    response = client.post("/v1/things", content=b'{"n": 1}', headers=headers)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_json" and "Content-Type: application/json" in error["message"]


def test_an_error_the_framework_raises_itself_has_a_code(client_and_registry):
    client, _ = client_and_registry
    response = client.get("/v1/refused-by-the-framework")
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_request"


def test_no_answer_says_which_server_runs_the_service():
    app, _ = build_app()
    server = LiveServer(app).start()
    try:
        answer = httpx.get(f"{server.url}/healthz")
    finally:
        server.stop()
    assert answer.status_code == 200 and "server" not in answer.headers


def test_a_wrong_method_names_the_method_and_the_one_allowed(client_and_registry):
    client, _ = client_and_registry
    response = client.put("/v1/things", json={"n": 1})
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"] == {
        "message": "PUT is not allowed on /v1/things; it takes POST",
        "type": "invalid_request_error",
        "param": None,
        "code": "method_not_allowed",
    }


def test_a_bug_is_a_json_500_naming_the_request_id_logged_once_and_counted(client_and_registry, caplog):
    client, registry = client_and_registry
    with caplog.at_level(logging.ERROR):
        response = client.get("/v1/broken", headers={"x-request-id": "req-bug-1"})
    assert response.status_code == 500 and response.headers["x-request-id"] == "req-bug-1"
    error = response.json()["error"]
    assert error["code"] == "internal_error" and error["type"] == "server_error"
    assert "req-bug-1" in error["message"] and "a bug" not in error["message"]
    tracebacks = [record for record in caplog.records if record.exc_info]
    assert len(tracebacks) == 1 and "a bug" in str(tracebacks[0].exc_info[1])
    assert registry.get_sample_value("ardit_t_api_errors_total", {"status": "500", "code": "internal_error"}) == 1


def test_a_bug_after_the_status_line_cuts_the_answer_short_instead_of_passing_it_as_complete():
    app, registry = build_app()
    server = LiveServer(app).start()
    try:
        with pytest.raises(httpx.RemoteProtocolError):
            httpx.get(f"{server.url}/v1/broken-midway")
    finally:
        server.stop()
    assert registry.get_sample_value("ardit_t_api_errors_total", {"status": "500", "code": "internal_error"}) == 1
