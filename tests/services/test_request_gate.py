"""The public port's gate on a real socket: key first, then the body's size and arrival time."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI, Request

from services.app import Readiness, create_app
from services.app_metrics import AppMetrics
from services.auth import BearerAuth
from services.drain import Drain
from services.fatal import Fatal
from services.metrics import new_registry
from services.request_gate import RequestGate
from tests.support.live_server import LiveServer

KEY = "sk-gate"
OPERATOR = "operator-token"
parsed: list[int] = []


def build() -> FastAPI:
    async def ready() -> Readiness:
        return Readiness(True, "ready")

    auth = BearerAuth([KEY], what="API key", missing_code="missing_api_key", invalid_code="invalid_api_key")
    registry = new_registry()
    metrics = AppMetrics(registry, "gate")
    app = create_app(
        "gate test",
        lifespan=None,
        readiness=ready,
        app_metrics=metrics,
        fatal=Fatal(),
        drain=Drain(1.0),
        gate=lambda inner: RequestGate(
            inner,
            auth=auth,
            max_body_bytes=1000,
            body_timeout=0.5,
            open_paths=("/healthz",),
            own_auth_prefixes=("/admin/",),
            on_refusal=metrics.count_error,
            open_get_prefixes=("/files/",),
            path_body_bytes={"/upload": 5000},
            guarded_paths={
                "/operator": BearerAuth(
                    [OPERATOR],
                    what="admin token",
                    missing_code="invalid_admin_token",
                    invalid_code="invalid_admin_token",
                )
            },
        ),
    )

    @app.get("/operator")
    async def operator() -> dict[str, bool]:
        return {"operator": True}

    @app.post("/upload")
    async def upload(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    @app.api_route("/files/{name}", methods=["GET", "POST"])
    async def file(name: str) -> dict[str, str]:
        return {"file": name}

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        body = await request.body()
        parsed.append(len(body))
        return {"bytes": len(body)}

    @app.post("/admin/thing")
    async def admin() -> dict[str, bool]:
        return {"admin": True}

    return app


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    live = LiveServer(build()).start()
    yield live
    live.stop()


def post(server: LiveServer, body: bytes, key: str | None = KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}/echo", content=body, headers=headers)


def test_a_good_request_passes_with_its_body(server):
    assert post(server, b"x" * 1000).json() == {"bytes": 1000}


def test_no_key_is_a_401_before_the_body_is_read(server):
    parsed.clear()
    response = post(server, b"x" * 10, key=None)
    assert response.status_code == 401 and response.json()["error"]["code"] == "missing_api_key"
    assert response.headers["x-request-id"] and not parsed


def test_a_non_ascii_key_is_a_401_not_a_crash(server):
    # httpx sends str headers as ASCII; send the raw bytes on a socket.
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xc3\xa9\xff\r\nContent-Length: 0\r\n\r\n"
        )
        assert sock.recv(100).startswith(b"HTTP/1.1 401")


def test_probes_and_own_auth_routes_skip_the_key(server):
    assert httpx.get(f"{server.url}/healthz").status_code == 200
    assert httpx.post(f"{server.url}/admin/thing").json() == {"admin": True}


def test_a_guarded_path_takes_its_own_token_and_no_api_key(server):
    def get(token: str | None) -> httpx.Response:
        return httpx.get(f"{server.url}/operator", headers={"authorization": f"Bearer {token}"} if token else {})

    assert get(OPERATOR).json() == {"operator": True}
    for refused in (get(KEY), get(None)):
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_admin_token"


def test_an_oversized_body_is_a_413_declared_or_not(server):
    assert post(server, b"x" * 1001).status_code == 413

    def chunked():
        yield b"x" * 600
        yield b"x" * 600

    response = httpx.post(f"{server.url}/echo", content=chunked(), headers={"authorization": f"Bearer {KEY}"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_a_body_that_does_not_arrive_is_a_408_after_the_deadline_and_the_connection_closes(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n"
            b"Content-Length: 1000\r\n\r\n" + b"x" * 10
        )
        sock.settimeout(30)  # a hang guard: the server answers at its deadline
        answer = b""
        while chunk := sock.recv(65536):  # to the end: the server closes the connection
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408")
    assert b"connection: close" in answer.lower()


def test_a_path_with_its_own_cap_takes_larger_bodies_and_no_more(server):
    headers = {"authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{server.url}/upload", content=b"x" * 5000, headers=headers).json() == {"bytes": 5000}
    assert httpx.post(f"{server.url}/upload", content=b"x" * 5001, headers=headers).status_code == 413
    assert post(server, b"x" * 1001).status_code == 413  # the other paths keep the general cap


def test_gets_under_an_open_prefix_need_no_key_other_methods_do(server):
    assert httpx.get(f"{server.url}/files/img_1.png").json() == {"file": "img_1.png"}
    assert httpx.post(f"{server.url}/files/img_1.png").status_code == 401
    assert httpx.get(f"{server.url}/echo").status_code == 401
