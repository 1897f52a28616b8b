"""``make run``: start the DiT and the AR service as two supervised processes on this machine.

Both get the same internal handoff token (a fresh random one unless ``ARDIT_HANDOFF_TOKEN`` is
set). The launcher prints the URL once the AR is ready, then supervises: a service that exits is
restarted with exponential backoff while the other keeps running (the AR answers 503 ``not_ready``
while its DiT is down, and serves again as soon as the DiT is back). A service that exits 0 stopped
because it was asked to (it drained): it is started again at once, and it is not a crash. A service that
crashes ``MAX_CRASHES`` times within ``CRASH_WINDOW_SECONDS`` is given up on, loudly, and the launcher
stops everything and exits non-zero. Ctrl-C or SIGTERM stops both as stopping one does: each drains
(SIGTERM: admitted work finishes within its drain period, new requests get 503, unfinished streams end
with an ``error`` event), and the launcher exits 0 once they have; a second Ctrl-C stops them at once.
The services get a parent-death signal, so they do not outlive a launcher that is killed outright. Every
other setting passes through from the environment (``ARDIT_AR_*``, ``ARDIT_DIT_*``, see README). A DiT given a
pipeline folder that ships its text encoder (Qwen-Image, Z-Image, FLUX.2 [klein] as published) gives the AR that
folder too, unless the AR is given one: the text encoder and the card that says how to read it are the DiT's.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from services.fatal import EXIT_SETTINGS
from services.lifetime import die_with_parent
from services.model_card import ships_text_encoder
from services.settings import DEFAULT_DRAIN_SECONDS

MAX_CRASHES = 5
CRASH_WINDOW_SECONDS = 120.0
BACKOFF_SECONDS = (1.0, 30.0)  # first restart delay, longest
POLL_SECONDS = 0.5
# What a draining service may take past its drain period to close its engine and exit.
STOP_MARGIN_SECONDS = 30.0
OPENMP_SPIN_ROUNDS = 10_000


def service_environment() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("ARDIT_HANDOFF_TOKEN", secrets.token_urlsafe(24))
    # The AR's engine and the DiT share this machine's cores, each with an OpenMP team as wide as the
    # machine. libgomp's threads spin at every barrier (300,000 rounds) before they sleep, so when both
    # compute at once a spinning thread holds the core the other's thread waits for; libgomp shortens the
    # spin itself when one team outnumbers the cores, but cannot see two processes doing so together. A
    # short spin served more images a minute than libgomp's default in every peer_compare cell, and more
    # evenly than not spinning at all (benchmarks/results/peer_compare.md). An operator's GOMP_SPINCOUNT wins.
    env.setdefault("GOMP_SPINCOUNT", str(OPENMP_SPIN_ROUNDS))
    dit_folder = env.get("ARDIT_DIT_MODEL_DIR")
    if dit_folder and ships_text_encoder(Path(dit_folder)):
        env.setdefault("ARDIT_AR_MODEL_DIR", dit_folder)
    ar_host, dit_host = env.get("ARDIT_AR_HOST", "127.0.0.1"), env.get("ARDIT_DIT_HOST", "127.0.0.1")
    env.setdefault("ARDIT_AR_DIT_URL", f"http://{dit_host}:{env.get('ARDIT_DIT_PORT', '8001')}")
    env["ARDIT_LAUNCHER_AR_URL"] = f"http://{ar_host}:{env.get('ARDIT_AR_PORT', '8000')}"
    return env


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM (a graceful stop) when the launcher dies, however it dies."""
    die_with_parent(signal.SIGTERM)


@dataclass
class Service:
    name: str
    module: str
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    crashes: deque[float] = field(default_factory=deque)
    restart_at: float | None = None

    def start(self) -> None:
        # Own session: a terminal's Ctrl-C reaches only the launcher, which then asks each service
        # once to shut down (a second SIGINT would make uvicorn skip its graceful shutdown).
        self.process = subprocess.Popen(
            [sys.executable, "-m", self.module], env=self.env, start_new_session=True, preexec_fn=_die_with_parent
        )
        self.restart_at = None

    def exited(self) -> int | None:
        """The exit code if it has exited since it was started, else None."""
        if self.process is None or self.restart_at is not None:
            return None
        return self.process.poll()

    def crashed(self, now: float) -> bool:
        """Record an exit; schedule the restart. False when it crashed too often to try again."""
        self.crashes.append(now)
        while self.crashes and now - self.crashes[0] > CRASH_WINDOW_SECONDS:
            self.crashes.popleft()
        if len(self.crashes) >= MAX_CRASHES:
            return False
        first, longest = BACKOFF_SECONDS
        self.restart_at = now + min(longest, first * 2 ** (len(self.crashes) - 1))
        return True

    def drain(self) -> None:
        """Ask it to stop as an orchestrator does (SIGTERM): it finishes what it admitted first."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop_now(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)

    def wait_stopped(self, seconds: float) -> None:
        if self.process is None:
            return
        try:
            self.process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    @property
    def drain_seconds(self) -> float:
        prefix = "ARDIT_AR_" if self.module == "ar_service" else "ARDIT_DIT_"
        return float(self.env.get(f"{prefix}DRAIN_SECONDS", DEFAULT_DRAIN_SECONDS))


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def say(message: str) -> None:
    print(f"ardit: {message}", file=sys.stderr, flush=True)


def supervise(services: list[Service], url: str, ready_timeout: float) -> int:
    started = time.monotonic()
    announced = False
    while True:
        now = time.monotonic()
        for service in services:
            code = service.exited()
            if code == EXIT_SETTINGS:
                say(f"{service.name} cannot start with these settings (see above); not restarting it")
                return 1
            if code == 0:  # asked to stop, and drained: not a crash
                say(f"{service.name} stopped (it was asked to); starting it again")
                service.start()
                continue
            if code is not None:
                if not service.crashed(now):
                    say(f"{service.name} crashed {MAX_CRASHES} times within {CRASH_WINDOW_SECONDS:g} s; giving up")
                    return 1
                delay = (service.restart_at or now) - now
                say(f"{service.name} exited with code {code}; restarting it in {delay:.0f} s")
            if service.restart_at is not None and now >= service.restart_at:
                service.start()
        if not announced and ready(url):
            announced = True
            print(f"\nardit is ready: {url}/v1/images/generations  (Ctrl-C stops both services)\n", flush=True)
        elif not announced and now - started > ready_timeout:
            say(f"not ready after {ready_timeout:g} s (see the log above)")
            return 1
        time.sleep(POLL_SECONDS)


def main() -> int:
    env = service_environment()
    services = [Service("dit", "dit_service", env), Service("ar", "ar_service", env)]
    # Ctrl-C and SIGTERM both stop the pair; SIGINT explicitly, since a launcher started in the
    # background inherits it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        for service in services:
            service.start()
        return supervise(services, env["ARDIT_LAUNCHER_AR_URL"], float(env.get("ARDIT_LAUNCHER_READY_TIMEOUT", "600")))
    except KeyboardInterrupt:
        return 0
    finally:
        stop(services)


def stop(services: list[Service]) -> None:
    """Drain every service, and wait for them (each at most its drain period and a margin); a second Ctrl-C or
    SIGTERM meanwhile stops them at once."""
    for service in services:
        service.drain()
    try:
        for service in services:
            service.wait_stopped(service.drain_seconds + STOP_MARGIN_SECONDS)
    except KeyboardInterrupt:
        say("stopping now, without waiting for the requests in flight")
        for service in services:
            service.stop_now()
        for service in services:
            service.wait_stopped(STOP_MARGIN_SECONDS)


if __name__ == "__main__":
    sys.exit(main())
