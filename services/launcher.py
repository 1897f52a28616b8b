"""``make run``: start the DiT and the AR service as two processes on this machine.

Both get the same internal handoff token (a fresh random one unless ``ARDIT_HANDOFF_TOKEN`` is
set). The launcher waits for the AR's ``/readyz``, prints the URL, and on Ctrl-C (or if either
service dies) stops both. Every other setting passes through from the environment
(``ARDIT_AR_*``, ``ARDIT_DIT_*``, see README).
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


def service_environment() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("ARDIT_HANDOFF_TOKEN", secrets.token_urlsafe(24))
    ar_host, dit_host = env.get("ARDIT_AR_HOST", "127.0.0.1"), env.get("ARDIT_DIT_HOST", "127.0.0.1")
    env.setdefault("ARDIT_AR_DIT_URL", f"http://{dit_host}:{env.get('ARDIT_DIT_PORT', '8001')}")
    env["ARDIT_LAUNCHER_AR_URL"] = f"http://{ar_host}:{env.get('ARDIT_AR_PORT', '8000')}"
    return env


def wait_ready(url: str, processes: list[subprocess.Popen[bytes]], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            return False
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    return False


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for p in processes:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in processes:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


def main() -> int:
    env = service_environment()
    url = env["ARDIT_LAUNCHER_AR_URL"]
    # Own sessions: a terminal's Ctrl-C reaches only the launcher, which then asks each service
    # once to shut down (a second SIGINT would make uvicorn skip its graceful shutdown).
    processes = [
        subprocess.Popen([sys.executable, "-m", "dit_service"], env=env, start_new_session=True),
        subprocess.Popen([sys.executable, "-m", "ar_service"], env=env, start_new_session=True),
    ]
    # Ctrl-C and SIGTERM both stop the pair; SIGINT explicitly, since a launcher started in the
    # background inherits it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if not wait_ready(url, processes, timeout=float(env.get("ARDIT_LAUNCHER_READY_TIMEOUT", "600"))):
            print("ardit: a service failed to start (see the log above)", file=sys.stderr)
            return 1
        print(f"\nardit is ready: {url}/v1/images/generations  (Ctrl-C stops both services)\n", flush=True)
        while all(p.poll() is None for p in processes):
            time.sleep(0.5)
        print("ardit: a service exited; stopping the other", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop(processes)


if __name__ == "__main__":
    sys.exit(main())
