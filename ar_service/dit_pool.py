"""The DiT replicas this AR sends handoffs to, and how one is chosen for each request.

``ARDIT_AR_DIT_URL`` is one or more base URLs (comma-separated); a host that is a DNS name is
expanded to its IPv4 addresses and re-resolved every ``resolve_seconds``, as a Kubernetes headless
Service gives them. Each replica is tracked actively (its ``/readyz``, which also carries its
capabilities) and passively (a request that cannot reach it marks it for a fresh probe).

A handoff goes to the ready replica with the fewest outstanding handoffs that still has room
(its announced ``max_outstanding``). If a replica is unreachable, or refuses before any row was
sent, the handoff is offered to the next one; once rows went out, it stays where it went: one
handoff's rows never reach two replicas. A replica that leaves the DNS answer takes no new work
and is closed when its last handoff ends.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import httpx

from ar_service.dit_peer import DitPeer
from ar_service.handoff_body import HandoffBody
from ar_service.handoff_client import (
    DitBusy,
    DitNotReady,
    DitUnavailable,
    DitUnreachable,
    HandoffClient,
    HandoffResult,
    PartialImageSink,
)
from ar_service.settings import ArSettings
from shared.capabilities import DitCapabilities

log = logging.getLogger("ardit.ar.dit_pool")

ClientFactory = Callable[[str], httpx.AsyncClient]


@dataclass(frozen=True)
class PoolState:
    ready: bool
    reason: str
    capabilities: DitCapabilities | None = None  # what every ready replica can do
    capacity: int = 0  # handoffs the ready replicas hold at once, together


@dataclass
class DitReplica:
    url: str
    client: httpx.AsyncClient
    peer: DitPeer
    handoff: HandoffClient
    outstanding: int = 0
    retired: bool = False

    def room(self) -> int:
        capabilities = self.peer.last.capabilities
        if not self.peer.last.ready or capabilities is None or self.retired:
            return 0
        return capabilities.capacity.max_outstanding - self.outstanding


@dataclass
class DitPool:
    targets: list[str]
    make_client: ClientFactory
    token: str | None
    deadline_seconds: float
    hidden_size: int
    conditioning: str
    replicas: dict[str, DitReplica] = field(default_factory=dict)

    @classmethod
    def of_settings(cls, settings: ArSettings, hidden_size: int) -> DitPool:
        """The pool ``ARDIT_AR_DIT_URL`` names, talking to each replica as the settings say."""

        def client(base_url: str) -> httpx.AsyncClient:
            # Reads and writes time out after the stall timeout: the DiT sends progress while it works
            # (queued or rendering), so silence that long means it froze.
            timeout = httpx.Timeout(settings.dit_stall_timeout_seconds, connect=settings.dit_connect_timeout_seconds)
            limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
            return httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits)

        return cls(
            targets=[url.strip().rstrip("/") for url in settings.dit_url.split(",") if url.strip()],
            make_client=client,
            token=settings.handoff_token.get_secret_value() if settings.handoff_token else None,
            deadline_seconds=settings.dit_timeout_seconds,
            hidden_size=hidden_size,
            conditioning=settings.conditioning,
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
            urls += await _expand(target)
        for url in urls:
            if url not in self.replicas:
                client = self.make_client(url)
                peer = DitPeer(client, hidden_size=self.hidden_size, conditioning=self.conditioning)
                self.replicas[url] = DitReplica(
                    url, client, peer, HandoffClient(client, self.token, self.deadline_seconds)
                )
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

    def forget(self) -> None:
        for replica in self.replicas.values():
            replica.peer.forget()

    async def exchange(
        self, request_id: str, body: HandoffBody, on_partial_image: PartialImageSink | None = None
    ) -> HandoffResult:
        tried: set[str] = set()
        while True:
            replica = self._pick(exclude=tried)
            if replica is None:
                self.forget()  # the next request probes every replica again
                raise DitUnavailable("no DiT replica is ready with room for this handoff")
            tried.add(replica.url)
            replica.outstanding += 1
            try:
                return await replica.handoff.exchange(request_id, body, on_partial_image)
            except (DitBusy, DitUnavailable) as exc:
                replica.peer.forget()
                # Rows already sent stay with that replica: the failure is the request's.
                if exc.rows_sent or not _refused_before_rows(exc):
                    raise
                log.warning("DiT replica %s refused or unreachable (%s); trying another", replica.url, exc)
            finally:
                replica.outstanding -= 1
                await self._close_if_done(replica)

    def _pick(self, exclude: set[str]) -> DitReplica | None:
        candidates = [r for r in self.replicas.values() if r.url not in exclude and r.room() > 0]
        return min(candidates, key=lambda r: r.outstanding, default=None)

    async def _close_if_done(self, replica: DitReplica) -> None:
        if replica.retired and replica.outstanding == 0 and self.replicas.get(replica.url) is replica:
            del self.replicas[replica.url]
            await replica.client.aclose()
            log.info("DiT replica %s closed", replica.url)

    async def aclose(self) -> None:
        for replica in self.replicas.values():
            await replica.client.aclose()
        self.replicas.clear()


def _refused_before_rows(exc: DitBusy | DitUnavailable) -> bool:
    """Unreachable (nothing was sent) or an HTTP refusal (503/429) rather than a failure mid-render."""
    return isinstance(exc, DitUnreachable | DitNotReady | DitBusy)


async def _expand(target: str) -> list[str]:
    parts = urlsplit(target)
    host = parts.hostname or ""
    if _is_ip(host):
        return [target]
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
    except OSError as exc:
        log.warning("cannot resolve DiT host %s: %s", host, exc)
        return []
    addresses = sorted({str(info[4][0]) for info in infos})
    return [urlunsplit((parts.scheme, f"{address}:{port}", parts.path, "", "")) for address in addresses]


def _is_ip(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
    except OSError:
        return False
    return True
