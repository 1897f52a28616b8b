"""The CPU compose stack (docker-compose.yml + docker-compose.cpu.yml) in real containers, driven by the real
Compose v2 binary against podman's Docker-compatible API: the AR, the DiT and Prometheus from the images
`make image` builds; healthchecks gate start-up; an image request through the published port returns a PNG;
Prometheus scrapes both services over the compose network; a DiT that dies is started again by its restart
policy and the AR serves again on its own; so does a killed AR.

`make test-containers` runs it (images, podman set-up, checkpoints). Set ARDIT_STACK_REPORT=FILE to write the
measured durations, image sizes and a log excerpt there as JSON.
"""

from __future__ import annotations

import base64
import io
import json
import os
import platform
import re
import secrets
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from PIL import Image

from services.checkpoints import AR_MODEL, DIT_MODEL, default_model_dir
from tests.deploy.compose_cli import CPU_FILES, compose, rendered
from tests.deploy.podman_stack import ApiSocket, HealthcheckRunner, inspect, podman
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.containers]

SERVICES = ("ar", "dit", "prometheus")
API_KEY = "sk-compose-stack-test"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
START_TIMEOUT_SECONDS = 900
RECOVERY_TIMEOUT_SECONDS = 600
SCRAPE_TIMEOUT_SECONDS = 60
# Start-up, readiness and failure lines of the services' logs (not the per-request access lines).
MILESTONE = re.compile(r"^(?!.*uvicorn\.access).*(ready|Uvicorn running|Started server|ERROR|Traceback|Killed)", re.I)
IMAGE_REQUEST = {"prompt": "a red cube on a table", "size": "64x64", "num_inference_steps": 2, "seed": 3}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ComposeStack:
    env: dict[str, str]
    project: str
    url: str
    healthchecks: HealthcheckRunner
    report: dict = field(default_factory=dict)

    def compose(self, *args: str, **kwargs):
        return compose(CPU_FILES, *args, env=self.env, **kwargs)

    def container(self, service: str) -> str:
        ids = self.compose("ps", "--all", "--quiet", service).stdout.split()
        assert len(ids) == 1, (service, ids)
        return ids[0]

    def generate(self, timeout: float = 300) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/images/generations",
            headers={"Authorization": f"Bearer {API_KEY}"},
            json=IMAGE_REQUEST,
            timeout=timeout,
        )

    def promql(self, query: str) -> list[dict]:
        """A query to Prometheus from inside its own container (promtool ships with Debian's package)."""
        result = podman(
            "exec", self.container("prometheus"),
            "promtool", "query", "instant", "-o", "json", "http://127.0.0.1:9090", query,
        )  # fmt: skip
        return json.loads(result.stdout)


def require_images(env: dict[str, str]) -> dict[str, int]:
    sizes = {}
    for service in rendered(CPU_FILES, env)["services"].values():
        image = service["image"]
        if service.get("build") and image.startswith("ardit"):
            found = podman("image", "inspect", image, check=False)
            if found.returncode != 0:
                pytest.fail(f"image {image} is missing: run `make image` (make test-containers does)")
            sizes[image] = json.loads(found.stdout)[0]["Size"]
    return sizes


def require_checkpoint(path: Path) -> str:
    if not path.is_dir():
        pytest.fail(f"checkpoint {path} is missing: run `make checkpoints` (make test-containers does)")
    return str(path)


def png_of(response: httpx.Response) -> Image.Image:
    assert response.status_code == 200, response.text
    data = base64.b64decode(response.json()["data"][0]["b64_json"])
    assert data.startswith(PNG_SIGNATURE)
    return Image.open(io.BytesIO(data))


def started_at(value: str) -> datetime:
    """podman's UTC timestamps carry nanoseconds; seconds are plenty here."""
    return datetime.fromisoformat(value[:19])


@pytest.fixture(scope="module")
def compose_stack(tmp_path_factory) -> Iterator[ComposeStack]:
    workdir = tmp_path_factory.mktemp("compose-stack")
    handoff_env = workdir / "handoff.env"
    handoff_env.write_text(f"ARDIT_HANDOFF_TOKEN={secrets.token_urlsafe(32)}\n")
    project = f"ardit-stack-{secrets.token_hex(3)}"
    port = free_port()
    env = {
        "COMPOSE_PROJECT_NAME": project,
        "ARDIT_AR_MODEL_HOST_DIR": require_checkpoint(default_model_dir(AR_MODEL)),
        "ARDIT_DIT_MODEL_HOST_DIR": require_checkpoint(default_model_dir(DIT_MODEL)),
        "ARDIT_HANDOFF_ENV_FILE": str(handoff_env),
        "ARDIT_AR_PUBLISH_PORT": str(port),
        "ARDIT_AR_API_KEYS": json.dumps([API_KEY]),
    }
    image_sizes = require_images(env)
    with ApiSocket() as api:
        env["DOCKER_HOST"] = api.docker_host
        healthchecks = HealthcheckRunner(project)
        healthchecks.start()
        stack = ComposeStack(env=env, project=project, url=f"http://127.0.0.1:{port}", healthchecks=healthchecks)
        stack.report.update(image_bytes=image_sizes)
        try:
            started = time.monotonic()
            stack.compose(
                "up", "--detach", "--no-build", "--wait", "--wait-timeout", str(START_TIMEOUT_SECONDS), *SERVICES,
                timeout=START_TIMEOUT_SECONDS + 60,
            )  # fmt: skip
            stack.report["up_until_healthy_seconds"] = round(time.monotonic() - started, 1)
            yield stack
        finally:
            logs = stack.compose("logs", "--no-color", "--timestamps", check=False).stdout
            (workdir / "compose.log").write_text(logs)
            stack.report["log_excerpt"] = [line for line in logs.splitlines() if MILESTONE.search(line)][-30:]
            stack.compose("down", "--volumes", "--timeout", "20", check=False, timeout=300)
            healthchecks.stop()
            write_report(stack.report)


def write_report(report: dict) -> None:
    target = os.environ.get("ARDIT_STACK_REPORT")
    if target:
        machine = {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "podman": podman("--version").stdout.strip(),
        }
        Path(target).write_text(json.dumps({"command": "make test-containers", "machine": machine, **report}, indent=2))


def test_the_dit_was_healthy_before_the_ar_started(compose_stack):
    dit, ar = compose_stack.container("dit"), compose_stack.container("ar")
    dit_healthy = compose_stack.healthchecks.first_healthy[dit]
    assert started_at(inspect(ar)["State"]["StartedAt"]) >= dit_healthy.replace(microsecond=0, tzinfo=None)
    for container in (dit, ar):
        assert inspect(container)["State"]["Health"]["Status"] == "healthy"


def test_an_image_request_through_the_published_port_returns_a_png(compose_stack):
    started = time.monotonic()
    image = png_of(compose_stack.generate())
    compose_stack.report["first_image_seconds"] = round(time.monotonic() - started, 2)
    assert image.size == (64, 64)


def test_the_published_port_wants_an_api_key(compose_stack):
    response = httpx.post(f"{compose_stack.url}/v1/images/generations", json=IMAGE_REQUEST, timeout=60)
    assert response.status_code == 401


def test_prometheus_scrapes_both_services_over_the_compose_network(compose_stack):
    deadline = time.monotonic() + SCRAPE_TIMEOUT_SECONDS
    while True:
        up = {sample["metric"]["job"]: sample["value"][1] for sample in compose_stack.promql("up")}
        requests = compose_stack.promql('sum(ardit_ar_requests_total{status="ok"})')
        if (up == {"ardit-ar": "1", "ardit-dit": "1"} and requests and float(requests[0]["value"][1]) >= 1) or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(2)
    assert up == {"ardit-ar": "1", "ardit-dit": "1"}
    assert requests and float(requests[0]["value"][1]) >= 1
    assert compose_stack.promql("ardit_dit_build_info"), "no DiT family scraped"


def test_service_images_run_unprivileged_offline_and_without_test_tools(compose_stack):
    container = compose_stack.container("ar")
    assert podman("exec", container, "id", "-u").stdout.strip() == "10001"
    assert podman("exec", container, "printenv", "HF_HUB_OFFLINE").stdout.strip() == "1"
    absent = "import importlib.util as u; print([m for m in ('pytest', 'hypothesis', 'triton') if u.find_spec(m)])"
    assert podman("exec", container, "python", "-c", absent).stdout.strip() == "[]"
    assert podman("exec", container, "touch", "/models/ar/written", check=False).returncode != 0
    podman("exec", container, "touch", "/cache/written")


def kill_and_wait_for_restart(stack: ComposeStack, service: str) -> float:
    """SIGKILL to the service's main process from the host (a crash, not a `stop`, which the policy respects);
    returns when podman has started the container again."""
    container = stack.container(service)
    before = inspect(container)
    os.kill(before["State"]["Pid"], signal.SIGKILL)
    killed = time.monotonic()
    wait_for(
        lambda: inspect(container)["RestartCount"] > before["RestartCount"],
        RECOVERY_TIMEOUT_SECONDS,
        f"{service} is restarted",
        every=0.5,
    )
    stack.report[f"{service}_restarted_after_seconds"] = round(time.monotonic() - killed, 1)
    return killed


def serve_again(stack: ComposeStack, killed: float, report_key: str) -> httpx.Response:
    while True:
        try:
            response = stack.generate()
        except httpx.TransportError:  # the AR's own port while its container restarts
            response = None
        if response is not None and response.status_code == 200:
            stack.report[report_key] = round(time.monotonic() - killed, 1)
            return response
        # While a service loads, the AR answers 503 (not ready): never a hang or a 500.
        assert response is None or response.status_code == 503, response.text
        assert time.monotonic() < killed + RECOVERY_TIMEOUT_SECONDS, "the AR did not serve again"
        time.sleep(2)


def test_a_killed_dit_is_restarted_by_its_policy_and_the_ar_serves_again(compose_stack):
    ar_restarts = inspect(compose_stack.container("ar"))["RestartCount"]
    killed = kill_and_wait_for_restart(compose_stack, "dit")
    assert png_of(serve_again(compose_stack, killed, "serving_again_after_dit_kill_seconds")).size == (64, 64)
    assert inspect(compose_stack.container("ar"))["RestartCount"] == ar_restarts


def test_a_killed_ar_is_restarted_by_its_policy_and_serves_again(compose_stack):
    killed = kill_and_wait_for_restart(compose_stack, "ar")
    assert png_of(serve_again(compose_stack, killed, "serving_again_after_ar_kill_seconds")).size == (64, 64)
