"""Point the running test AR at other DiTs for one test, the way its DNS answer would change.

The AR's one ``DitPool`` is given other targets and resolved again (what its resolver loop does
every few seconds when a headless Service's addresses change); afterwards it gets its own back.
Replicas that leave retire once their last handoff is over, as in production.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ar_service.dit_pool import DitPool


@contextmanager
def pointed_at(stack, *urls: str) -> Iterator[DitPool]:
    dits: DitPool = stack.runtime.dits
    before = dits.targets
    dits.targets = [url.rstrip("/") for url in urls]
    stack.ar.call(dits.refresh())
    try:
        yield dits
    finally:
        dits.targets = before
        stack.ar.call(dits.refresh())
