"""The AR app's own routes, without starting its engine (no lifespan)."""

from __future__ import annotations

from starlette.testclient import TestClient

from ar_service.app import create_ar_app
from ar_service.settings import ArSettings
from tests.conftest import require_checkpoint


def unstarted_app(**settings) -> TestClient:
    require_checkpoint(ArSettings().model_dir)  # its tokenizer
    return TestClient(create_ar_app(ArSettings(**settings)))  # not entered: the engine never starts


def test_an_empty_admin_token_disables_the_admin_endpoint():
    for token in (None, ""):
        response = unstarted_app(admin_token=token).post(
            "/admin/reset_prefix_cache", headers={"authorization": "Bearer "}
        )
        assert response.status_code == 404


def test_the_admin_endpoint_wants_its_own_token_not_an_api_key():
    app = unstarted_app(admin_token="admin-secret", api_keys=["sk-user"])
    assert app.post("/admin/reset_prefix_cache", headers={"authorization": "Bearer sk-user"}).status_code == 401


def test_requests_are_503_not_ready_while_the_engine_loads():
    response = unstarted_app().post("/v1/images/generations", json={"prompt": "x"})
    assert response.status_code == 503 and response.json()["error"]["code"] == "not_ready"
