"""An app made by ``services.app.create_app`` with no routes of its own yet, always ready: what the
tests of the shared app layer (errors, metrics) add their routes to."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from services.app import Readiness, create_app
from services.app_metrics import AppMetrics
from services.drain import Drain
from services.fatal import Fatal


class Body(BaseModel):
    n: int


async def ready() -> Readiness:
    return Readiness(True, "ready")


def bare_app(registry: CollectorRegistry | None = None, **layers: Any) -> tuple[FastAPI, CollectorRegistry]:
    """The app, and the registry its metrics (prefix ``ardit_t_``) go to; ``layers``: ``create_app``'s connection
    layers (``connections``, ``slow_readers``), made on that ``registry``."""
    registry = registry or CollectorRegistry()
    return create_app(
        "test",
        lifespan=None,
        readiness=ready,
        app_metrics=AppMetrics(registry, "t"),
        fatal=Fatal(),
        drain=Drain(1.0),
        **layers,
    ), registry
