"""One image request is one trace: the AR's spans and the DiT's, in parent/child order, recorded by
the OpenTelemetry SDK's in-memory exporter (the test stack runs both services in this process); and
an AR started with the standard OTEL_* variables exports its spans and vLLM's over OTLP, in the
same trace as the DiT's."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tests.conftest import API_KEY, HANDOFF_TOKEN, Stack
from tests.support.otlp_collector import OtlpCollector, ReceivedSpan
from tests.support.ports import free_port
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
EXPORTED_TRACE_ID = "5c1ab2f3577b34da6a3ce929d0e0e473"
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


def ended(spans: InMemorySpanExporter, name: str, request_id: str, timeout: float = 30.0) -> ReadableSpan:
    """The span ``name`` of the request, once it has ended."""

    def found() -> list[ReadableSpan]:
        named = [span for span in spans.get_finished_spans() if span.name == name]
        return [span for span in named if (span.attributes or {}).get("ardit.request_id") == request_id]

    wait_for(found, timeout, f"the span {name} of {request_id} ends", every=0.1)
    return found()[0]


def trace_of(spans: InMemorySpanExporter, request_id: str) -> list[ReadableSpan]:
    """Every span of the request's trace, once the DiT's run (the last to end) has ended."""
    ended(spans, "ardit.dit.handoff", request_id)
    trace_id = ended(spans, SERVER_SPAN, request_id).context.trace_id
    return [s for s in spans.get_finished_spans() if s.context.trace_id == trace_id]


def one(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    [span] = [s for s in spans if s.name == name]
    return span


def interval(span: ReadableSpan) -> tuple[int, int]:
    """When an ended span started and ended (nanoseconds)."""
    assert span.start_time is not None and span.end_time is not None, f"{span.name} has not ended"
    return span.start_time, span.end_time


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
    assert handoff.instrumentation_scope is not None and dit.instrumentation_scope is not None
    assert handoff.instrumentation_scope.name == "ardit.ar" and dit.instrumentation_scope.name == "ardit.dit"
    stages = [one(spans_of_request, name) for name in DIT_STAGES]
    assert all(parent_of(stage) == dit.context.span_id for stage in stages)
    assert dit.attributes is not None and server.attributes is not None
    assert dit.attributes["ardit.request_id"] == request_id and server.attributes["http.route"] == (
        "/v1/images/generations"
    )

    # Time order: each span inside its parent; the DiT's stages one after another.
    def inside(child: ReadableSpan, parent: ReadableSpan) -> bool:
        (child_start, child_end), (parent_start, parent_end) = interval(child), interval(parent)
        return parent_start <= child_start and child_end <= parent_end

    assert inside(handoff, server) and inside(dit, handoff)
    receive, queue, denoise, vae_decode, encode = (interval(stage) for stage in stages)  # (start, end) each
    assert receive[1] <= queue[1] <= denoise[0]
    assert denoise[1] <= vae_decode[0] and vae_decode[1] <= encode[0]


def test_a_request_without_traceparent_starts_its_own_trace(stack, spans):
    request_id = generate(stack, {})
    spans_of_request = trace_of(spans, request_id)
    server = one(spans_of_request, SERVER_SPAN)
    assert server.parent is None
    assert (
        parent_of(one(spans_of_request, "ardit.dit.handoff"))
        == one(spans_of_request, "ardit.ar.handoff").context.span_id
    )


@contextmanager
def ar_process(stack: Stack, collector: OtlpCollector, log: Path) -> Iterator[str]:
    """``python -m ar_service`` in its own process, traced only through OTEL_* variables, on the stack's
    DiT; yields its URL once ready, and stops it (engine included) however the test ends."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "ARDIT_AR_MODEL_DIR": str(stack.settings.model_dir),
        "ARDIT_AR_DIT_URL": stack.dit.url,
        "ARDIT_HANDOFF_TOKEN": HANDOFF_TOKEN,
        "ARDIT_AR_PORT": str(port),
        "ARDIT_AR_KV_CACHE_BYTES": str(128 << 20),
        "ARDIT_AR_MAX_MODEL_LEN": "1024",
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        # vLLM's engine processes read only the traces-specific protocol variable.
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    # A file, not a pipe: vLLM logs more than a pipe holds, and a full pipe would stall the service.
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "ar_service"], cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:

        def running_and_ready() -> bool:
            assert process.poll() is None, log.read_text()[-4000:]
            try:
                readiness = httpx.get(f"{url}/readyz")
            except httpx.TransportError:
                return False
            assert "failed" not in readiness.json()["reason"], f"the AR did not get ready:\n{log.read_text()[-4000:]}"
            return readiness.status_code == 200

        wait_for(running_and_ready, 600, "the AR is ready", every=0.5, state=lambda: log.read_text()[-4000:])
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_otel_variables_export_the_ars_spans_and_vllms_in_the_dits_trace(stack, spans, tmp_path):
    with OtlpCollector() as collector, ar_process(stack, collector, tmp_path / "ar.log") as url:
        response = httpx.post(
            f"{url}/v1/images/generations",
            headers={"traceparent": f"00-{EXPORTED_TRACE_ID}-{CLIENT_SPAN_ID}-01"},
            json={"prompt": "an exported teapot", "size": "64x64", "num_inference_steps": 2},
            timeout=300,
        )
        assert response.status_code == 200, response.text

        def received() -> dict[str, ReceivedSpan]:
            return {s.name: s for s in collector.spans if s.trace_id == EXPORTED_TRACE_ID}

        wait_for(lambda: len(received()) >= 3, 30, "three spans exported", every=0.1, state=received)
    exported = received()
    assert set(exported) == {SERVER_SPAN, "ardit.ar.handoff", "llm_request"}
    assert {span.service for span in exported.values()} == {"ardit-ar"}
    server, handoff = exported[SERVER_SPAN], exported["ardit.ar.handoff"]
    assert server.parent_span_id == CLIENT_SPAN_ID and handoff.parent_span_id == server.span_id
    # vLLM's own span for the engine request, and the DiT's, are children of the AR's handoff span.
    assert exported["llm_request"].parent_span_id == handoff.span_id
    dit = ended(spans, "ardit.dit.handoff", response.headers["x-request-id"])
    assert dit.parent is not None
    assert format(dit.parent.span_id, "016x") == handoff.span_id


def test_a_url_images_name_is_in_no_span(stack: Stack, spans: InMemorySpanExporter) -> None:
    response = httpx.post(
        f"{stack.api_base}/images/generations",
        headers={"authorization": f"Bearer {API_KEY}"},
        json={"prompt": "a traced teapot", "size": "64x64", "num_inference_steps": 2, "response_format": "url"},
        timeout=300,
    )
    link = response.json()["data"][0]["url"]
    assert httpx.get(link).status_code == 200
    image_id = link.rsplit("/", 1)[1].split(".")[0]
    recorded = [(span.name, dict(span.attributes or {})) for span in spans.get_finished_spans()]
    assert recorded and image_id not in repr(recorded)
