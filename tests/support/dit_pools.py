"""Point the running test AR at other DiTs (a pool of real ones, or nobody) for one test."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from ar_service.dit_pool import DitPool


def dit_pool(stack, *urls: str, timeout: float = 60.0) -> DitPool:
    settings = stack.settings
    pool = DitPool(
        [u.rstrip("/") for u in urls],
        make_client=lambda url: httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout, connect=2.0)),
        token=settings.handoff_token.get_secret_value() if settings.handoff_token else None,
        deadline_seconds=timeout,
        hidden_size=stack.runtime.engine.shape.hidden_size,
        conditioning=settings.conditioning,
    )
    stack.ar.call(pool.refresh())
    return pool


@contextmanager
def using_dits(stack, pool: DitPool, *, for_readiness: bool = True) -> Iterator[DitPool]:
    """Requests go to ``pool`` (and, with ``for_readiness``, readiness asks it too)."""
    runtime = stack.runtime
    generator_dits, readiness_dits = runtime.generator.dit, runtime.readiness.dits
    runtime.generator.dit = pool
    if for_readiness:
        runtime.readiness.dits = pool
    try:
        yield pool
    finally:
        runtime.generator.dit, runtime.readiness.dits = generator_dits, readiness_dits
        stack.ar.call(pool.aclose())
