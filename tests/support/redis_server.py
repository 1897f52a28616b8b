"""A real Redis (Debian's redis-server, which `make test` installs) on a loopback port, started for a test."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis

from tests.support.ports import free_port
from tests.support.waiting import holds_within


@contextmanager
def redis_server(maxmemory: str = "64mb") -> Iterator[str]:
    """A fresh, empty Redis with the settings docs/scale-out.md gives operators; yields its URL."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (`make test` installs it from Debian's packages)")
    port = free_port()
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    args += ["--maxmemory", maxmemory, "--maxmemory-policy", "volatile-ttl"]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)

        def answers_or_exited() -> bool:
            if process.poll() is not None:
                return True
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        if not holds_within(answers_or_exited, 10) or process.poll() is not None:
            raise RuntimeError("redis-server did not start")
        client.close()
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)
