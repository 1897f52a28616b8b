"""Tracing is off unless the standard OTEL_* variables switch it on, and a W3C traceparent survives
the trip through the handoff's open frame."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

from services.tracing import (
    context_from_traceparent,
    current_traceparent,
    exporter_names,
    otlp_traces_endpoint,
    tracer_provider_from_env,
)

OTEL_VARIABLES = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_SERVICE_NAME",
)
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def env(monkeypatch):
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def set_env(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    return set_env


def exporters(provider: TracerProvider) -> list[SpanExporter]:
    processors = provider._active_span_processor._span_processors
    batched = [processor for processor in processors if isinstance(processor, BatchSpanProcessor)]
    assert len(batched) == len(processors), f"every span processor is a BatchSpanProcessor: {processors}"
    return [processor.span_exporter for processor in batched]


def test_off_without_any_otel_variable(env):
    assert exporter_names() == []
    assert tracer_provider_from_env("ar") is None
    assert otlp_traces_endpoint() is None


@pytest.mark.parametrize(
    ("variables", "names"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
        ({"OTEL_TRACES_EXPORTER": "otlp,console"}, ["otlp", "console"]),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, []),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, []),
    ],
)
def test_the_standard_variables_choose_the_exporters(env, variables, names):
    env(**variables)
    assert exporter_names() == names


def tracing_on(service: str) -> TracerProvider:
    provider = tracer_provider_from_env(service)
    assert provider is not None, "tracing is off"
    return provider


def test_otlp_is_grpc_unless_the_protocol_says_http(env):
    env(OTEL_EXPORTER_OTLP_ENDPOINT="http://collector:4317")
    [exporter] = exporters(tracing_on("ar"))
    assert isinstance(exporter, GrpcExporter)
    env(OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf")
    [exporter] = exporters(tracing_on("ar"))
    assert isinstance(exporter, HttpExporter)


def test_console_exporter_and_service_name(env):
    env(OTEL_TRACES_EXPORTER="console")
    provider = tracing_on("dit")
    assert [type(e) for e in exporters(provider)] == [ConsoleSpanExporter]
    assert provider.resource.attributes["service.name"] == "ardit-dit"
    env(OTEL_SERVICE_NAME="dit-eu-1")
    assert tracing_on("dit").resource.attributes["service.name"] == "dit-eu-1"


def test_an_unknown_exporter_or_protocol_is_an_error_not_silence(env):
    env(OTEL_TRACES_EXPORTER="zipkin-typo")
    with pytest.raises(ValueError, match="zipkin-typo"):
        tracer_provider_from_env("ar")
    env(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_PROTOCOL="http/json")
    with pytest.raises(ValueError, match="http/json"):
        tracer_provider_from_env("ar")


@pytest.mark.parametrize(
    ("variables", "endpoint"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, "http://collector:4317"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
            "http://collector:4318/v1/traces",
        ),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4318/x", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://b:1"},
            "http://t:4318/x",
        ),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, None),
    ],
)
def test_vllm_gets_the_traces_endpoint_only_when_otlp_is_on(env, variables, endpoint):
    env(**variables)
    assert otlp_traces_endpoint() == endpoint


def test_a_traceparent_round_trips_through_a_context():
    context = context_from_traceparent(TRACEPARENT)
    with trace.use_span(trace.get_current_span(context)):
        assert current_traceparent() == TRACEPARENT
    assert context_from_traceparent(None) is None


def test_no_traceparent_without_a_span():
    assert current_traceparent() is None
