"""A real Redis (Debian's redis-server, which `make test` installs) on a loopback port, started for a test."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis

from tests.support.ports import free_port


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
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        client.close()
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)
