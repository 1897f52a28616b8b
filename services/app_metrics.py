"""What every ardit app exports from the app factory: its HTTP responses, its error bodies, its readiness.

Every HTTP response is counted by route template, method and status by prometheus-fastapi-instrumentator's
middleware (pinned; vLLM's own server uses it): a pure ASGI middleware that resolves the route template the
way FastAPI matches routes (including the router nodes FastAPI >= 0.116 nests under ``include_router``) and
sees every response, also those that never reach a route handler: 404 for an unknown path, 401 from an auth
dependency, 400 from validation, 503 before readiness. Paths no route matches share the route label
``none`` and unknown methods the method label ``OTHER``, so a scanner cannot grow the label set.

OpenAI-shaped error bodies are counted where they are rendered (services/errors.py), by HTTP status and
``error.code`` — including errors that reach a client as an event of a stream that had already answered 200.

Readiness is what ``/readyz`` answers, evaluated at every scrape, so alerts see a service that is up but
cannot serve.
"""

from __future__ import annotations

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_fastapi_instrumentator.metrics import Info
from prometheus_fastapi_instrumentator.middleware import PrometheusInstrumentatorMiddleware

from services.errors import ApiError
from services.metrics import LATENCY_BUCKETS, Families

HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class AppMetrics:
    """The app-level families of one service; ``service`` is its subsystem (``ar``, ``dit``)."""

    def __init__(self, registry: CollectorRegistry, service: str) -> None:
        families = Families(registry, service)
        self.registry = registry  # every family of the service, /metrics' source
        self.requests = families.counter(
            "http_requests", "HTTP responses by route template, method and status code.", ("route", "method", "status")
        )
        self.request_seconds = families.histogram(
            "http_request_seconds",
            "HTTP request received to its last response byte (streams included), by route template and method.",
            LATENCY_BUCKETS,
            ("route", "method"),
        )
        self.errors = families.counter(
            "api_errors", "OpenAI-shaped error bodies sent, by HTTP status and error code.", ("status", "code")
        )
        self.ready = families.gauge("ready", "1 when /readyz answers ready, else 0 (evaluated at each scrape).")
        # Each label set's series, kept: prometheus_client's ``labels`` checks and locks on every call, which the
        # AR's door would pay three times over in each refusal of a burst. The label values are bounded (route
        # templates, ``none``, known methods, HTTP statuses, error codes).
        self._response_series: dict[tuple[str, str, str], tuple[Counter, Histogram]] = {}
        self._error_series: dict[tuple[str, str], Counter] = {}

    def install(self, app: FastAPI) -> None:
        """Counts every response of ``app``; add it after the app's other middleware (outermost)."""
        app.add_middleware(
            PrometheusInstrumentatorMiddleware,
            should_group_status_codes=False,
            should_group_untemplated=True,
            instrumentations=[self._observe],
        )

    def count_error(self, error: ApiError) -> None:
        key = (str(error.status), error.code or "none")
        counter = self._error_series.get(key)
        if counter is None:
            counter = self._error_series[key] = self.errors.labels(*key)
        counter.inc()

    def observe_response(self, route: str, method: str, status: str, seconds: float) -> None:
        """One response: what the middleware counts, and what a layer in front of it answers itself."""
        method = method if method in HTTP_METHODS else "OTHER"
        key = (route, method, status)
        series = self._response_series.get(key)
        if series is None:
            series = self._response_series[key] = (
                self.requests.labels(*key),
                self.request_seconds.labels(route, method),
            )
        count, seconds_of = series
        count.inc()
        seconds_of.observe(seconds)

    def _observe(self, info: Info) -> None:
        self.observe_response(info.modified_handler, info.method, info.modified_status, info.modified_duration)
