"""podman standing in for a Docker engine on machines that have none (this project's sandboxed development
machines, deploy/podman/containers.conf): its Docker-compatible API socket for Compose v2, and a runner for the
containers' healthchecks, which podman schedules with systemd timers and these machines have no systemd.
The runner only calls `podman healthcheck run` on each container's own interval; podman applies the
healthcheck's command, timeout, retries and start period as it would under systemd."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from tests.deploy.compose_cli import ROOT
from tests.support.waiting import holds_within

CONTAINERS_CONF = ROOT / "deploy" / "podman" / "containers.conf"


def podman_env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(CONTAINERS_CONF))}


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    result = subprocess.run(["podman", *args], env=podman_env(), capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, f"podman {' '.join(args)}: {result.stderr}"
    return result


def inspect(container: str) -> dict:
    return json.loads(podman("container", "inspect", container).stdout)[0]


class ApiSocket:
    """`podman system service` on a private unix socket, for as long as the context lasts."""

    def __init__(self):
        self._dir = tempfile.TemporaryDirectory(prefix="ardit-podman-")
        self.path = Path(self._dir.name) / "podman.sock"
        self.docker_host = f"unix://{self.path}"
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> ApiSocket:
        self._process = subprocess.Popen(
            ["podman", "system", "service", "--time=0", self.docker_host],
            env=podman_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(self.path)), base_url="http://podman") as client:

            def answers() -> bool:
                try:
                    return client.get("/_ping").text == "OK"
                except httpx.TransportError:
                    return False

            if holds_within(answers, 30, every=0.2):
                return self
        self.__exit__()
        raise RuntimeError("podman system service did not answer on its socket within 30 s")

    def __exit__(self, *exc_info) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._dir.cleanup()


class HealthcheckRunner(threading.Thread):
    """Runs the healthchecks of a compose project's running containers, each on its configured interval, and
    notes when each container's first passing check began (podman's health log keeps only the latest few)."""

    def __init__(self, project: str):
        super().__init__(name=f"healthchecks-{project}", daemon=True)
        self.project = project
        self._stopping = threading.Event()
        self._due: dict[str, float] = {}
        self.first_healthy: dict[str, datetime] = {}

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=60)

    def run(self) -> None:
        while not self._stopping.wait(1.0):
            listed = podman(
                "ps", "--filter", f"label=com.docker.compose.project={self.project}", "--format", "json", check=False
            )
            if listed.returncode != 0:
                continue
            for container in json.loads(listed.stdout or "[]"):
                self._check_if_due(container["Id"])

    def _check_if_due(self, container: str) -> None:
        now = time.monotonic()
        if self._due.get(container, 0.0) > now:
            return
        listed = podman("container", "inspect", container, check=False)
        if listed.returncode != 0:
            return
        healthcheck = json.loads(listed.stdout)[0]["Config"].get("Healthcheck")
        if not healthcheck:
            self._due[container] = float("inf")
            return
        self._due[container] = now + healthcheck["Interval"] / 1e9
        began = datetime.now(UTC)
        result = podman("healthcheck", "run", container, check=False, timeout=healthcheck["Timeout"] / 1e9 + 30)
        if result.returncode == 0:
            self.first_healthy.setdefault(container, began)
