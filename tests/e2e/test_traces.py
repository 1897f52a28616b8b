"""One image request is one trace: the AR's spans and the DiT's, in parent/child order, recorded by
the OpenTelemetry SDK's in-memory exporter (the test stack runs both services in this process)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tests.conftest import API_KEY, Stack

pytestmark = pytest.mark.slow

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
SERVER_SPAN = "POST /v1/images/generations"
DIT_STAGES = ("ardit.dit.receive", "ardit.dit.queue", "ardit.dit.denoise", "ardit.dit.vae_decode", "ardit.dit.encode")


@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    # The process-wide provider can be set once; the services' tracers resolve to it when it is.
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()


def generate(stack: Stack, headers: dict[str, str]) -> str:
    response = httpx.post(
        f"{stack.api_base}/images/generations",
        headers={"authorization": f"Bearer {API_KEY}", **headers},
        json={"prompt": "a traced teapot", "size": "64x64", "num_inference_steps": 2},
        timeout=300,
    )
    assert response.status_code == 200, response.text
    return response.headers["x-request-id"]


def trace_of(spans: InMemorySpanExporter, request_id: str, timeout: float = 30.0) -> list[ReadableSpan]:
    """Every span of the request's trace, once the DiT's run (the last to end) has ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        finished = spans.get_finished_spans()
        dit = [s for s in finished if s.name == "ardit.dit.handoff" and s.attributes["ardit.request_id"] == request_id]
        server = [s for s in finished if s.name == SERVER_SPAN and s.attributes.get("ardit.request_id") == request_id]
        if dit and server:
            return [s for s in finished if s.context.trace_id == server[0].context.trace_id]
        time.sleep(0.1)
    pytest.fail(f"the spans of {request_id} did not all end")


def one(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    [span] = [s for s in spans if s.name == name]
    return span


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def test_one_request_is_one_trace_with_both_services_spans_in_order(stack, spans):
    request_id = generate(stack, {"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"})
    spans_of_request = trace_of(spans, request_id)
    assert {s.context.trace_id for s in spans_of_request} == {int(CLIENT_TRACE_ID, 16)}
    assert {s.name for s in spans_of_request} == {SERVER_SPAN, "ardit.ar.handoff", "ardit.dit.handoff", *DIT_STAGES}

    server = one(spans_of_request, SERVER_SPAN)
    handoff = one(spans_of_request, "ardit.ar.handoff")
    dit = one(spans_of_request, "ardit.dit.handoff")
    # The caller's span is the parent of the AR's server span; each service's spans nest below.
    assert parent_of(server) == int(CLIENT_SPAN_ID, 16) and server.kind == SpanKind.SERVER
    assert parent_of(handoff) == server.context.span_id and handoff.kind == SpanKind.CLIENT
    assert parent_of(dit) == handoff.context.span_id and dit.kind == SpanKind.SERVER
    assert handoff.instrumentation_scope.name == "ardit.ar" and dit.instrumentation_scope.name == "ardit.dit"
    stages = [one(spans_of_request, name) for name in DIT_STAGES]
    assert all(parent_of(stage) == dit.context.span_id for stage in stages)
    assert dit.attributes["ardit.request_id"] == request_id and server.attributes["http.route"] == (
        "/v1/images/generations"
    )

    # Time order: each span inside its parent; the DiT's stages one after another.
    def inside(child: ReadableSpan, parent: ReadableSpan) -> bool:
        return parent.start_time <= child.start_time and child.end_time <= parent.end_time

    assert inside(handoff, server) and inside(dit, handoff)
    receive, queue, denoise, vae_decode, encode = stages
    assert receive.end_time <= queue.end_time <= denoise.start_time
    assert denoise.end_time <= vae_decode.start_time and vae_decode.end_time <= encode.start_time


def test_a_request_without_traceparent_starts_its_own_trace(stack, spans):
    request_id = generate(stack, {})
    spans_of_request = trace_of(spans, request_id)
    server = one(spans_of_request, SERVER_SPAN)
    assert server.parent is None
    assert (
        parent_of(one(spans_of_request, "ardit.dit.handoff"))
        == one(spans_of_request, "ardit.ar.handoff").context.span_id
    )
