"""The DiT replicas this AR sends handoffs to, and how one is chosen for each request.

``ARDIT_AR_DIT_URL`` is one or more base URLs (comma-separated); a host that is a DNS name is
expanded to its IPv4 addresses and re-resolved every ``resolve_seconds``, as a Kubernetes headless
Service gives them (a lookup that fails keeps the last answer: a DNS hiccup retires nobody). Each
replica is tracked actively (its ``/readyz``, which also carries its capabilities) and passively (a
request that cannot reach it marks it for a fresh probe).

A request reserves a place at the ready replica with the fewest outstanding handoffs that still has
room (its announced ``max_outstanding``), before any engine work; a replica that is unreachable, not
ready or busy refuses the reservation and the next one is asked. The handoff then goes where the
place is: one request's rows never reach two replicas. A replica that leaves the DNS answer takes no
new work and is closed when its last handoff ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from ar_service.dit_peer import DitPeer
from ar_service.handoff_body import HandoffBody
from ar_service.handoff_client import (
    DitBusy,
    DitUnavailable,
    HandoffClient,
    HandoffResult,
    PartialImageSink,
)
from ar_service.settings import ArSettings
from shared.capabilities import DitCapabilities
from shared.row_recipe import RowRecipe

log = logging.getLogger("ardit.ar.dit_pool")

# A replica's HTTP session, made when its URL first appears.
SessionFactory = Callable[[], aiohttp.ClientSession]


def dit_session(settings: ArSettings) -> aiohttp.ClientSession:
    """The HTTP session the AR talks to one DiT replica with (made inside the running event loop)."""
    # Reads time out after the stall timeout (writes: ``HandoffClient``): the DiT sends progress while it
    # works (queued or rendering), so silence that long means it froze.
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=settings.dit_connect_timeout_seconds, sock_read=settings.dit_stall_timeout_seconds
    )
    # Idle connections are dropped before the DiT's server drops them (uvicorn's 5 s keep-alive), so a request
    # does not go out on a connection the DiT is closing.
    connector = aiohttp.TCPConnector(limit=64, keepalive_timeout=4.0)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar())


@dataclass(frozen=True)
class PoolState:
    ready: bool
    reason: str
    capabilities: DitCapabilities | None = None  # what every ready replica can do
    capacity: int = 0  # handoffs the ready replicas hold at once, together


@dataclass
class DitReplica:
    url: str
    session: aiohttp.ClientSession
    peer: DitPeer
    handoff: HandoffClient
    outstanding: int = 0
    retired: bool = False

    def room(self) -> int:
        capabilities = self.peer.last.capabilities
        if not self.peer.last.ready or capabilities is None or self.retired:
            return 0
        return capabilities.capacity.max_outstanding - self.outstanding


@dataclass(frozen=True)
class ReservedDit:
    """A DiT replica holding a place for one request: where its handoff goes."""

    client: HandoffClient
    request_id: str
    reservation: str

    async def exchange(self, body: HandoffBody, on_partial_image: PartialImageSink | None = None) -> HandoffResult:
        return await self.client.exchange(self.request_id, self.reservation, body, on_partial_image)


@dataclass
class DitPool:
    targets: list[str]
    make_session: SessionFactory
    token: str | None
    deadline_seconds: float
    stall_seconds: float
    rows: RowRecipe  # how this AR reads the rows it streams
    row_width: int
    replicas: dict[str, DitReplica] = field(default_factory=dict)
    _resolved: dict[str, list[str]] = field(default_factory=dict)  # each target's last good DNS answer

    @classmethod
    def of_settings(cls, settings: ArSettings, rows: RowRecipe, row_width: int) -> DitPool:
        """The pool ``ARDIT_AR_DIT_URL`` names, talking to each replica as the settings say."""

        return cls(
            targets=[url.strip().rstrip("/") for url in settings.dit_url.split(",") if url.strip()],
            make_session=functools.partial(dit_session, settings),
            token=settings.handoff_token.get_secret_value() if settings.handoff_token else None,
            deadline_seconds=settings.dit_timeout_seconds,
            stall_seconds=settings.dit_stall_timeout_seconds,
            rows=rows,
            row_width=row_width,
        )

    async def keep_resolved(self, interval: float) -> None:
        """Resolve the targets again every ``interval`` seconds, until cancelled: DiT replicas come
        and go with their DNS answer (a Kubernetes headless Service)."""
        while True:
            await self.refresh()
            await asyncio.sleep(interval)

    async def refresh(self) -> None:
        """Resolve the targets again: new addresses become replicas, vanished ones retire."""
        urls: list[str] = []
        for target in self.targets:
            expanded = await _expand(target)
            # A failed lookup says nothing about the replicas: keep the ones this target gave last time.
            urls += self._resolved.get(target, []) if expanded is None else expanded
            if expanded is not None:
                self._resolved[target] = expanded
        for url in urls:
            if url not in self.replicas:
                session = self.make_session()
                peer = DitPeer(session, url, rows=self.rows, row_width=self.row_width)
                handoff = HandoffClient(
                    session, url, self.token, deadline_seconds=self.deadline_seconds, stall_seconds=self.stall_seconds
                )
                self.replicas[url] = DitReplica(url, session, peer, handoff)
                log.info("DiT replica %s added", url)
            self.replicas[url].retired = False
        for url, replica in list(self.replicas.items()):
            if url not in urls and not replica.retired:
                replica.retired = True
                log.info("DiT replica %s left the DNS answer; it takes no new handoffs", url)
            await self._close_if_done(replica)

    async def state(self) -> PoolState:
        """Probe the replicas (each at most every few seconds) and merge what the ready ones say."""
        live = [r for r in self.replicas.values() if not r.retired]
        states = await asyncio.gather(*(r.peer.state() for r in live))
        ready = [s for s in states if s.ready and s.capabilities is not None]
        if not ready:
            reasons = "; ".join(sorted({s.reason for s in states})) or "no DiT replica resolved"
            return PoolState(False, reasons)
        capabilities = DitCapabilities.common([s.capabilities for s in ready if s.capabilities is not None])
        capacity = sum(s.capabilities.capacity.max_outstanding for s in ready if s.capabilities is not None)
        return PoolState(True, f"ready ({len(ready)}/{len(live)} DiT replicas)", capabilities, capacity)

    def known(self) -> PoolState:
        """What the replicas ready at their last probe can do together, without probing."""
        ready = [
            c
            for r in self.replicas.values()
            if not r.retired and r.peer.last.ready and (c := r.peer.last.capabilities) is not None
        ]
        if not ready:
            return PoolState(False, "no DiT replica known to be ready")
        capacity = sum(c.capacity.max_outstanding for c in ready)
        return PoolState(True, "ready", DitCapabilities.common(ready), capacity)

    def forget(self) -> None:
        for replica in self.replicas.values():
            replica.peer.forget()

    @asynccontextmanager
    async def reserve(self, request_id: str) -> AsyncIterator[ReservedDit]:
        """A place at the ready replica with the fewest outstanding handoffs that has room, reserved before
        any engine work; a replica that refuses (busy, not ready, unreachable) is skipped for the next.
        The place is the request's until the block ends. ``DitBusy`` when every replica asked was full,
        ``DitUnavailable`` when none could take it for another reason."""
        tried: set[str] = set()
        busy = False
        while True:
            replica = self._pick(exclude=tried)
            if replica is None:
                self.forget()  # the next request probes every replica again
                if busy:
                    raise DitBusy("every DiT replica is full")
                raise DitUnavailable("no DiT replica is ready with room for this request")
            tried.add(replica.url)
            replica.outstanding += 1  # counted while it is asked: concurrent requests spread out
            try:
                reservation = await _reserved(replica, request_id)
                break
            except (DitBusy, DitUnavailable) as exc:
                busy = busy or isinstance(exc, DitBusy)
                replica.peer.forget()
                log.warning("DiT replica %s refused a reservation (%s); trying another", replica.url, exc)
                await self._done_with(replica)
            except BaseException:
                await self._done_with(replica)
                raise
        try:
            yield ReservedDit(replica.handoff, request_id, reservation)
        except BaseException as exc:
            if isinstance(exc, DitBusy | DitUnavailable):
                replica.peer.forget()  # probe it again before it is trusted with the next request
            # If the handoff never reached the DiT, its place is free again now, not when it lapses.
            await replica.handoff.cancel(request_id, reservation)
            raise
        finally:
            await self._done_with(replica)

    async def _done_with(self, replica: DitReplica) -> None:
        replica.outstanding -= 1
        await self._close_if_done(replica)

    def _pick(self, exclude: set[str]) -> DitReplica | None:
        candidates = [r for r in self.replicas.values() if r.url not in exclude and r.room() > 0]
        return min(candidates, key=lambda r: r.outstanding, default=None)

    async def _close_if_done(self, replica: DitReplica) -> None:
        if replica.retired and replica.outstanding == 0 and self.replicas.get(replica.url) is replica:
            del self.replicas[replica.url]
            await replica.session.close()
            log.info("DiT replica %s closed", replica.url)

    async def aclose(self) -> None:
        for replica in self.replicas.values():
            await replica.session.close()
        self.replicas.clear()


async def _reserved(replica: DitReplica, request_id: str) -> str:
    """``replica``'s reservation for the request. A request cancelled meanwhile (its client left) still
    lets the answer arrive and gives the place back, rather than leave it held until it lapses."""
    asking = asyncio.ensure_future(replica.handoff.reserve(request_id))
    try:
        return await asyncio.shield(asking)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await replica.handoff.cancel(request_id, await asking)
        raise


async def _expand(target: str) -> list[str] | None:
    """The target's URL for each IPv4 address its host has; None when the lookup failed."""
    parts = urlsplit(target)
    host = parts.hostname or ""
    if _is_ip(host):
        return [target]
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
    except OSError as exc:
        log.warning("cannot resolve DiT host %s (keeping its last answer): %s", host, exc)
        return None
    addresses = sorted({str(info[4][0]) for info in infos})
    return [urlunsplit((parts.scheme, f"{address}:{port}", parts.path, "", "")) for address in addresses]


def _is_ip(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
    except OSError:
        return False
    return True
