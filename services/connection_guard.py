"""Connections that send no request: a request head must arrive within a deadline and under a size cap,
and the open connections are capped below the process's file limit, the idle ones giving way first.

uvicorn bounds what happens after a request (``timeout_keep_alive`` closes a connection idle after its
answer; the app's ``RequestGate`` bounds the body) but not what comes before one: under httptools a
connection that never sends a head, or sends it a byte at a time, stays open, and a head has no size
limit (a 64 MB header is parsed and held). Held by thousands, such connections reach the file limit and
then nobody, ``/healthz`` included, gets an answer. The guard watches each connection where its bytes
arrive, in asyncio's ``Protocol`` callbacks of the HTTP protocol class uvicorn's ``Config`` runs (as
``SlowReaders`` does for writes), with a parser of its own (httptools, the one uvicorn uses) that tells
where each request head begins and ends:

- a head must be complete within ``head_timeout`` seconds of the connection opening, or of its first
  byte on a connection kept alive; otherwise the connection is closed (with a 408 when the head had
  begun on a fresh connection);
- a head over ``max_head_bytes`` is answered 431 and the connection closed; the bytes past the cap
  never reach uvicorn;
- with ``body_timeout`` set, a request's body must end within it (and ``BODY_GRACE``) of its head: the
  app's ``RequestGate`` answers a body it reads that late with 408, but a body nobody reads — after an
  early answer, a 401 or 429 — uvicorn drops as it comes, and a client that sends it a byte at a time
  would hold the connection for ever; it is closed, without an answer (one was given);
- past ``max_connections`` open connections, a new one closes the oldest that has not sent a complete
  head (the ones that cost a slow or silent client nothing), so that real clients and probes always get
  in; with none such, the new one is closed.

A 408 or 431 is written only on the connection's first request: on a later one an earlier answer may
still be going out, and bytes of another would corrupt it, so that connection is just closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections.abc import Callable
from typing import Any, TypeVar, cast

import httptools

from services.errors import ApiError
from services.metrics import Families

log = logging.getLogger("ardit.connections")

P = TypeVar("P", bound=asyncio.Protocol)

CLOSE_REASONS = ("head_timeout", "head_too_large", "body_timeout", "evicted", "over_capacity")
# Files a service keeps for itself beyond its connections: model files, pipes to the engine, sockets to peers.
RESERVED_FILES = 1024
FEWEST_CONNECTIONS = 64
# The gate's body deadline starts a moment after the head (the door's decision): this grace lets its 408 go out
# before the guard closes the connection.
BODY_GRACE = 1.0


def default_max_connections() -> int:
    """The open-file limit raised to its hard limit (as Go's runtime does at start), less what the process keeps
    for itself."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # an unlimited hard limit: the kernel refuses it as a soft one
            pass
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20  # the kernel's own cap (fs.nr_open) is of that order
    return max(FEWEST_CONNECTIONS, soft - RESERVED_FILES)


class ConnectionGuard:
    def __init__(
        self,
        families: Families,
        *,
        head_timeout: float,
        max_head_bytes: int,
        max_connections: int | None,
        body_timeout: float | None = None,
    ) -> None:
        """``body_timeout``: None where a body may last as long as its sender's work (the DiT's handoff streams
        rows while the AR decodes)."""
        self.head_timeout = head_timeout
        self.body_timeout = body_timeout
        self.max_head_bytes = max_head_bytes
        self.max_connections = max_connections if max_connections is not None else default_max_connections()
        self._open: set[asyncio.BaseTransport] = set()
        # Connections without a complete head, oldest first: the ones to close when a new one needs room.
        self._headless: dict[asyncio.BaseTransport, None] = {}
        self.closed = families.counter(
            "connections_closed",
            "Connections the service closed for its client's pace or at the cap, by reason (head_timeout: no "
            "complete request head in time; head_too_large: over the head cap, answered 431; body_timeout: a body "
            "still arriving past its deadline, after its answer; evicted: headless, closed to make room for a new "
            "one at the connection cap; over_capacity: new, at the cap with none headless).",
            ("reason",),
            start=CLOSE_REASONS,
        )
        self.open_connections = families.gauge("connections_open", "Open client connections.")
        self.open_connections.set_function(lambda: len(self._open))

    def opened(self, transport: asyncio.BaseTransport) -> bool:
        """A new connection: False when it was closed at once (the cap reached, none headless to give way)."""
        if len(self._open) >= self.max_connections:
            if not self._headless:
                self._close(transport, "over_capacity")
                return False
            oldest = next(iter(self._headless))
            self._close(oldest, "evicted")
            self.lost(oldest)
        self._open.add(transport)
        self._headless[transport] = None
        return True

    def head_begun(self, transport: asyncio.BaseTransport) -> None:
        if transport in self._open:
            self._headless.setdefault(transport, None)

    def head_complete(self, transport: asyncio.BaseTransport) -> None:
        self._headless.pop(transport, None)

    def lost(self, transport: asyncio.BaseTransport) -> None:
        self._open.discard(transport)
        self._headless.pop(transport, None)

    def refuse(self, transport: asyncio.BaseTransport, reason: str, answer: bytes | None) -> None:
        """Close a connection whose head is late or too large, with ``answer`` written first if given."""
        if answer is not None and not transport.is_closing():
            # A write transport, if not asyncio's class: uvloop's (what uvicorn runs on) derives from none of them.
            cast(asyncio.WriteTransport, transport).write(answer)
        self._close(transport, reason)

    def _close(self, transport: asyncio.BaseTransport, reason: str) -> None:
        if transport.is_closing():
            return
        # Debug only: thousands of these are an attack's own log flood; the counter is what to watch.
        log.debug("closing the connection of %s: %s", transport.get_extra_info("peername"), reason)
        self.closed.labels(reason).inc()
        transport.close()

    def protocol(self, base: type[P]) -> type[P]:
        """``base`` (a uvicorn HTTP protocol class) with each connection's heads watched by this guard."""
        guard = self

        class Guarded(base):  # type: ignore[valid-type,misc]
            ardit_heads: HeadWatch | None = None
            ardit_transport: asyncio.BaseTransport | None = None

            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.ardit_transport = transport
                super().connection_made(transport)
                if guard.opened(transport):
                    self.ardit_heads = HeadWatch(guard, transport)

            def data_received(self, data: bytes) -> None:
                if self.ardit_heads is None or self.ardit_heads.received(data):
                    super().data_received(data)

            def connection_lost(self, exc: Exception | None) -> None:
                if self.ardit_heads is not None:
                    self.ardit_heads.stop()
                if self.ardit_transport is not None:
                    guard.lost(self.ardit_transport)
                super().connection_lost(exc)

        return Guarded


class HeadWatch:
    """One connection's request heads, as httptools parses them: when each begins and ends, and its size."""

    def __init__(self, guard: ConnectionGuard, transport: asyncio.BaseTransport) -> None:
        self._guard = guard
        self._transport = transport
        self._parser: Any = httptools.HttpRequestParser(self)
        self._heads = 0  # begun on this connection
        self._in_head = True  # a connection opens waiting for its first head
        self._head_bytes = 0
        self._body_bytes = 0  # of the chunk being parsed
        self._head_begun = False  # in the chunk being parsed
        self._timer: asyncio.TimerHandle | None = None
        self._arm(guard.head_timeout, self._late)

    def received(self, data: bytes) -> bool:
        """Parse ``data``; False when the connection was refused and uvicorn must not see it."""
        if self._parser is None:
            return True
        in_head = self._in_head
        self._body_bytes = 0
        self._head_begun = False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # The services run no WebSocket protocol (``services.serve``): uvicorn serves an upgrade request as
            # a plain one, and parsing goes on, for uvicorn and here alike.
            pass
        except httptools.HttpParserError:
            self.stop()  # a malformed head is uvicorn's to answer (400), and it closes the connection
            return True
        if in_head or self._head_begun:
            # The chunk's bytes that are not body are head (two whole heads pipelined in one chunk count
            # together: a client that pipelines heads of tens of KB is none ardit knows).
            self._head_bytes += len(data) - self._body_bytes
            if self._head_bytes > self._guard.max_head_bytes:
                self.stop()
                message = f"the request head is over {self._guard.max_head_bytes} bytes"
                answer = self._answer(
                    431, "Request Header Fields Too Large", message, "request_header_fields_too_large"
                )
                self._guard.refuse(self._transport, "head_too_large", answer)
                return False
        return True

    def stop(self) -> None:
        """No more watching: the connection is closing, refused, upgraded, or uvicorn's to answer."""
        self._parser = None
        self._disarm()
        self._guard.head_complete(self._transport)

    # httptools' callbacks
    def on_message_begin(self) -> None:
        self._heads += 1
        self._head_begun = True
        if not self._in_head:
            self._in_head = True
            self._head_bytes = 0
            self._guard.head_begun(self._transport)
            self._arm(self._guard.head_timeout, self._late)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        self._guard.head_complete(self._transport)
        if self._guard.body_timeout is not None:
            self._arm(self._guard.body_timeout + BODY_GRACE, self._body_late)

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)

    def on_message_complete(self) -> None:
        if not self._in_head:
            self._disarm()

    def _arm(self, seconds: float, late: Callable[[], None]) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(seconds, late)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _late(self) -> None:
        self._timer = None
        if not cast(asyncio.ReadTransport, self._transport).is_reading():
            # uvicorn stopped reading (a pipelined request waits for the one before it): the head's lateness is
            # the service's, not the client's.
            self._arm(self._guard.head_timeout, self._late)
            return
        begun = self._head_bytes > 0
        self.stop()
        message = f"the request head did not arrive within {self._guard.head_timeout:g} s"
        answer = self._answer(408, "Request Timeout", message, "request_timeout") if begun else None
        self._guard.refuse(self._transport, "head_timeout", answer)

    def _body_late(self) -> None:
        self._timer = None
        if not cast(asyncio.ReadTransport, self._transport).is_reading():
            # uvicorn paused reading (the app has not taken the body yet): the wait is the service's.
            self._arm(BODY_GRACE, self._body_late)
            return
        self.stop()
        self._guard.refuse(self._transport, "body_timeout", None)

    def _answer(self, status: int, reason: str, message: str, code: str) -> bytes | None:
        """The answer written before closing: OpenAI's error body, on the connection's first request only."""
        if self._heads > 1:
            return None
        body = json.dumps(ApiError(status, message, code=code).body())
        head = (
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        return (head + body).encode()
