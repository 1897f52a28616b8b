"""Every response of an app made by create_app is counted by route template, method and status, and
every error body by its code — also responses that never reach a route handler."""

from __future__ import annotations

import pytest
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from services.app import Readiness, create_app
from services.app_metrics import AppMetrics
from services.auth import BearerAuth
from services.drain import Drain
from services.errors import ApiError
from services.fatal import Fatal
from tests.support.bare_app import Body, bare_app


def build_app() -> tuple[FastAPI, CollectorRegistry]:
    app, registry = bare_app()
    keys = BearerAuth(["k"], what="API key", missing_code="missing_api_key", invalid_code="invalid_api_key")

    def check(request: Request) -> None:
        keys.check(request.headers.get("authorization"))

    router = APIRouter(dependencies=[Depends(check)])

    @router.post("/v1/things/{name}")
    async def make(name: str, body: Body) -> dict[str, int]:
        if name == "busy":
            raise ApiError(503, "not ready", code="not_ready")
        if name == "broken":
            raise RuntimeError("a bug")
        return {"n": body.n}

    app.include_router(router)
    return app, registry


def count(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


AUTH = {"authorization": "Bearer k"}


@pytest.mark.parametrize(
    ("path", "headers", "body", "status", "code"),
    [
        ("/v1/things/a", AUTH, {"n": 1}, "200", None),
        ("/v1/things/a", {}, {"n": 1}, "401", "missing_api_key"),
        ("/v1/things/a", {"authorization": "Bearer wrong"}, {"n": 1}, "401", "invalid_api_key"),
        ("/v1/things/a", AUTH, {"n": "one"}, "400", "invalid_value"),
        ("/v1/things/busy", AUTH, {"n": 1}, "503", "not_ready"),
        ("/v1/things/broken", AUTH, {"n": 1}, "500", "internal_error"),
    ],
)
def test_a_templated_route_counts_every_outcome(client_and_registry, path, headers, body, status, code):
    client, registry = client_and_registry
    assert client.post(path, json=body, headers=headers).status_code == int(status)
    labels = {"route": "/v1/things/{name}", "method": "POST", "status": status}
    assert count(registry, "ardit_t_http_requests_total", **labels) == 1
    assert count(registry, "ardit_t_http_request_seconds_count", route="/v1/things/{name}", method="POST") == 1
    errors = count(registry, "ardit_t_api_errors_total", status=status, code=code or "none")
    assert errors == (0 if code is None else 1)


def test_unknown_paths_and_methods_share_one_label_each(client_and_registry):
    client, registry = client_and_registry
    for path in ("/nope", "/wp-admin/x", "/v1/things"):
        assert client.get(path).status_code == 404
    # A method no route serves at a known path: 405, naming the method the route takes.
    wrong = client.request("BREW", "/v1/things/a")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["message"] == "BREW is not allowed on /v1/things/a; it takes POST"
    assert count(registry, "ardit_t_http_requests_total", route="none", method="GET", status="404") == 3
    assert count(registry, "ardit_t_http_requests_total", route="/v1/things/{name}", method="OTHER", status="405") == 1
    assert count(registry, "ardit_t_api_errors_total", status="404", code="not_found") == 3
    assert count(registry, "ardit_t_api_errors_total", status="405", code="method_not_allowed") == 1


def test_probes_and_scrapes_are_counted_too(client_and_registry):
    client, registry = client_and_registry
    client.get("/healthz")
    client.get("/metrics")
    assert count(registry, "ardit_t_http_requests_total", route="/healthz", method="GET", status="200") == 1
    assert count(registry, "ardit_t_http_requests_total", route="/metrics", method="GET", status="200") == 1


def test_readiness_is_exported_as_it_is_at_each_scrape():
    registry = CollectorRegistry()
    state = {"ready": False}

    async def readiness() -> Readiness:
        return Readiness(state["ready"], "ready" if state["ready"] else "loading")

    app = create_app(
        "test",
        lifespan=None,
        readiness=readiness,
        app_metrics=AppMetrics(registry, "t"),
        fatal=Fatal(),
        drain=Drain(1.0),
    )
    with TestClient(app) as client:
        client.get("/metrics")
        assert count(registry, "ardit_t_ready") == 0
        state["ready"] = True
        client.get("/metrics")
        assert count(registry, "ardit_t_ready") == 1
