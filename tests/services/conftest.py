"""Fixtures the services' tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry


@pytest.fixture
def client_and_registry(request: pytest.FixtureRequest) -> Iterator[tuple[TestClient, CollectorRegistry]]:
    """A test client of the app the test's module builds with its ``build_app()``, and that app's registry. A bug
    is answered as the server answers it (a 500), not raised into the test: the answer is what is checked."""
    app, registry = request.module.build_app()
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, registry
