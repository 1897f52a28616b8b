"""The DiT's spans for one handoff, joined to the sender's trace through the open frame's ``traceparent``.

    ardit.dit.handoff            SERVER, first byte of the handoff to the end of its pipeline run
      ardit.dit.receive          first byte to the accepted close
      ardit.dit.queue            waiting for a pipeline slot
      ardit.dit.denoise          per image (previews included: they are taken between steps)
      ardit.dit.vae_decode       per image
      ardit.dit.encode           per image

Every span is started with an explicit parent (and, where it is measured after the fact, explicit
times), so the worker thread that renders needs no context of its own. A handoff whose open frame
has no ``traceparent`` starts a trace of its own; ``HandoffTrace()`` (no handoff, e.g. a warm-up
run) records nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from services.tracing import context_from_traceparent
from shared.frames import OpenFrame

tracer = trace.get_tracer("ardit.dit")


class HandoffTrace:
    def __init__(self, span: Span = INVALID_SPAN) -> None:
        self._span = span
        self._context = trace.set_span_in_context(span)

    @classmethod
    def received(cls, frame: OpenFrame, first_byte_ns: int) -> HandoffTrace:
        """The handoff's span (from its first byte) with its finished ``receive`` child."""
        params = frame.diffusion
        span = tracer.start_span(
            "ardit.dit.handoff",
            context=context_from_traceparent(frame.traceparent),
            kind=SpanKind.SERVER,
            start_time=first_byte_ns,
            attributes={
                "ardit.request_id": frame.request_id,
                "ardit.model": frame.model,
                "ardit.conditioning": frame.rows.conditioning,
                "ardit.image.width": params.width,
                "ardit.image.height": params.height,
                "ardit.image.count": params.num_images,
                "ardit.num_inference_steps": params.num_inference_steps,
            },
        )
        handoff = cls(span)
        handoff._child("ardit.dit.receive", first_byte_ns).end()
        return handoff

    def queued(self, seconds: float) -> None:
        """The wait for a pipeline slot, which ended now."""
        self._child("ardit.dit.queue", time.time_ns() - round(seconds * 1e9)).end()

    @contextmanager
    def stage(self, name: str, **attributes: AttributeValue) -> Iterator[None]:
        """A span around one stage of the run (``denoise``, ``vae_decode``, ``encode``)."""
        span = self._child(f"ardit.dit.{name}", time.time_ns(), attributes)
        with trace.use_span(span, end_on_exit=True):
            yield

    def end(self, finished: bool) -> None:
        """The run is over: finished, or failed or abandoned."""
        if not finished:
            self._span.set_status(Status(StatusCode.ERROR, "the pipeline run did not finish"))
        self._span.end()

    def _child(self, name: str, start_ns: int, attributes: dict[str, AttributeValue] | None = None) -> Span:
        if not self._span.is_recording():
            return INVALID_SPAN
        return tracer.start_span(name, context=self._context, start_time=start_ns, attributes=attributes)
