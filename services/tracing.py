"""Traces with OpenTelemetry: off by default, switched on by the standard ``OTEL_*`` variables.

``configure_tracing`` (each service's ``__main__``, once per process) installs an SDK tracer
provider when ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``console``, ...) or, with that
variable unset, when an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``). ``otlp`` sends over gRPC unless
``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`` says ``http/protobuf`` (the Python SDK's rule). Sampler,
batching, headers and the service name come from the SDK's own variables (``OTEL_TRACES_SAMPLER``,
``OTEL_BSP_*``, ``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_SERVICE_NAME``, ...). The SDK's own
environment configurator is private API and would also set up metric and log exporters (ardit's
metrics are Prometheus'), hence these few lines. Without a provider every span is a no-op.

``instrument_app`` gives every HTTP request a server span whose parent comes from the request's
W3C ``traceparent`` header: OpenTelemetry's ASGI middleware, named by the route template the
metrics use (prometheus-fastapi-instrumentator's resolver). With tracing off it steps in only for a
request that carries a ``traceparent`` (to pass it on to the DiT): its per-request work is not a
no-op even when its spans are, and it was about half of what a refused request cost. Not OpenTelemetry's FastAPI
instrumentation: it also patches Starlette's ``BackgroundTask`` process-wide, which gives every
streamed response's clean-up a root span of its own. Probes and ``/metrics`` are not traced. The
AR→DiT handoff carries its trace context in the ``open`` frame instead (``traceparent``,
shared/HANDOFF_SPEC.md): the contract, not the transport, says which trace a handoff belongs to.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from importlib.metadata import entry_points

from fastapi import FastAPI
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_fastapi_instrumentator.routing import get_route_name
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from services.app_metrics import HTTP_METHODS

_OTLP_BY_PROTOCOL = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}
_W3C = TraceContextTextMapPropagator()
SpanDetails = Callable[[Scope], tuple[str, dict[str, str]]]


def _otlp_protocol() -> str:
    return (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    ).strip()


def exporter_names() -> list[str]:
    """The span exporters the environment asks for; empty: tracing is off."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = os.environ.get("OTEL_TRACES_EXPORTER")
    if names is None:
        endpoint_set = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        return ["otlp"] if endpoint_set else []
    return [name for name in (n.strip() for n in names.split(",")) if name and name.lower() != "none"]


def _exporter(name: str) -> SpanExporter:
    if name == "otlp":
        protocol = _otlp_protocol()
        if protocol not in _OTLP_BY_PROTOCOL:
            raise ValueError(f"unsupported OTLP protocol {protocol!r} (grpc or http/protobuf)")
        name = _OTLP_BY_PROTOCOL[protocol]
    found = entry_points(group="opentelemetry_traces_exporter", name=name)
    if not found:
        raise ValueError(f"no span exporter named {name!r} is installed (OTEL_TRACES_EXPORTER)")
    exporter: SpanExporter = next(iter(found)).load()()
    return exporter


def tracer_provider_from_env(service: str) -> TracerProvider | None:
    """A provider exporting to what ``OTEL_*`` names, or None when tracing is off."""
    names = exporter_names()
    if not names:
        return None
    provider = TracerProvider(
        resource=Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME") or f"ardit-{service}"})
    )
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
    return provider


def configure_tracing(service: str) -> bool:
    """Installs the process-wide tracer provider; True when tracing is on."""
    provider = tracer_provider_from_env(service)
    if provider is not None:
        trace.set_tracer_provider(provider)
    return provider is not None


def otlp_traces_endpoint() -> str | None:
    """Where OTLP traces go, for libraries that take the endpoint as a setting (vLLM); None if not OTLP."""
    if "otlp" not in exporter_names():
        return None
    if endpoint := os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return endpoint
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if base is None:
        return None
    # The generic endpoint is a base URL for OTLP/HTTP (signal paths appended), the target itself for gRPC.
    return f"{base.rstrip('/')}/v1/traces" if _otlp_protocol() == "http/protobuf" else base


def _server_span_details(scope: Scope) -> tuple[str, dict[str, str]]:
    method = scope.get("method", "")
    method = method if method in HTTP_METHODS else "HTTP"
    route = get_route_name(Request(scope), should_include_root_path=False)
    return (f"{method} {route}", {"http.route": route}) if route else (method, {})


def instrument_app(app: FastAPI, untraced_paths: Iterable[str] = ()) -> None:
    """A server span per HTTP request, except for the paths ``untraced_paths`` match (regular
    expressions over the whole path, without commas: OpenTelemetry splits on them).

    Add it after the app's other middleware (outermost), so its span is current in all of them.
    """
    excluded = ",".join(f"{pattern}$" for pattern in untraced_paths)
    app.add_middleware(
        _TracedWhenUseful,
        excluded_urls=excluded,
        default_span_details=_server_span_details,
    )


class _TracedWhenUseful:
    """OpenTelemetry's ASGI middleware when a tracer provider is installed (checked per request: tests
    install one after the app is made), or when the request continues a trace; the app itself otherwise."""

    def __init__(self, app: ASGIApp, excluded_urls: str, default_span_details: SpanDetails) -> None:
        self.app = app
        self.traced = OpenTelemetryMiddleware(
            app,
            excluded_urls=excluded_urls,
            default_span_details=default_span_details,
            exclude_spans=["receive", "send"],
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        useful = isinstance(trace.get_tracer_provider(), TracerProvider) or any(
            name == b"traceparent" for name, _ in scope.get("headers", ())
        )
        await (self.traced if useful else self.app)(scope, receive, send)


def current_traceparent() -> str | None:
    """The W3C traceparent of the current span (None when there is none to continue)."""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier)
    return carrier.get("traceparent")


def context_from_traceparent(traceparent: str | None) -> Context | None:
    """The trace context a W3C traceparent names (None: start a new trace)."""
    return _W3C.extract({"traceparent": traceparent}) if traceparent else None
