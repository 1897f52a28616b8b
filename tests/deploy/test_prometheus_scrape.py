"""A real Prometheus, configured like deploy/prometheus/prometheus.yml, scrapes the real pair:
every family the dashboard charts is there, and every dashboard query evaluates without error.

Prometheus comes from Debian's package (`make prometheus`; `make test` runs it first).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from tests.conftest import API_KEY, Stack
from tests.deploy.dashboard import CHARTED_FAMILIES, ROOT, load, promql, targets
from tests.support.ports import free_port

pytestmark = pytest.mark.slow

IMAGE_REQUESTS = 3
STARTUP_SECONDS = 60.0
SCRAPE_WAIT_SECONDS = 60.0


def scrape_config(stack: Stack) -> dict:
    """The shipped config, with the compose targets swapped for the loopback services and a 1 s
    scrape so the test waits seconds, not minutes."""
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    addresses = {"ardit-ar": urlsplit(stack.ar.url).netloc, "ardit-dit": urlsplit(stack.dit.url).netloc}
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [addresses[job["job_name"]]]}]
    return config


def wait_for(condition, timeout: float, what: str, log: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}; prometheus log:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def traffic(stack: Stack) -> int:
    """A few image requests, so labelled families and histograms have samples."""
    for i in range(IMAGE_REQUESTS):
        response = httpx.post(
            f"{stack.ar.url}/v1/images/generations",
            headers={"Authorization": f"Bearer {API_KEY}"},
            json={"prompt": f"a red cube, take {i}", "size": "64x64", "num_inference_steps": 2},
            timeout=300,
        )
        assert response.status_code == 200, response.text
    return IMAGE_REQUESTS


@pytest.fixture(scope="module")
def prometheus(stack: Stack, traffic: int, tmp_path_factory) -> Iterator[httpx.Client]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("the prometheus binary is missing: run `make prometheus` (make test does)")
    workdir = tmp_path_factory.mktemp("prometheus")
    config_file = workdir / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(scrape_config(stack)))
    log = workdir / "prometheus.log"
    url = f"http://127.0.0.1:{free_port()}"
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config_file}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address={urlsplit(url).netloc}",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    client = httpx.Client(base_url=url, timeout=10)
    try:
        wait_for(lambda: ready(client), STARTUP_SECONDS, "prometheus to start", log)
        # A scrape after the traffic: the request counter shows every request.
        wait_for(lambda: requests_seen(client) >= traffic, SCRAPE_WAIT_SECONDS, "a scrape after the traffic", log)
        # rate() needs two samples in its window; a few 1 s scrapes more give it them.
        time.sleep(3)
        yield client
    finally:
        client.close()
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def ready(client: httpx.Client) -> bool:
    try:
        return client.get("/-/ready").status_code == 200
    except httpx.TransportError:
        return False


def query(client: httpx.Client, promql: str) -> dict:
    return client.get("/api/v1/query", params={"query": promql}).json()


def requests_seen(client: httpx.Client) -> float:
    result = query(client, 'sum(ardit_ar_requests_total{status="ok"})')["data"]["result"]
    return float(result[0]["value"][1]) if result else 0.0


def test_both_services_are_scraped_up(prometheus):
    active = prometheus.get("/api/v1/targets").json()["data"]["activeTargets"]
    assert {(t["labels"]["job"], t["health"]) for t in active} == {("ardit-ar", "up"), ("ardit-dit", "up")}


@pytest.mark.parametrize("family", CHARTED_FAMILIES)
def test_charted_family_is_scraped_from_its_service(prometheus, family):
    body = prometheus.get("/api/v1/series", params={"match[]": f'{{__name__="{family}"}}'}).json()
    assert body["status"] == "success", body
    jobs = {series["job"] for series in body["data"]}
    assert jobs == {"ardit-dit" if family.startswith("ardit_dit_") else "ardit-ar"}


DASHBOARD_QUERIES = [
    pytest.param(promql(target["expr"]), id=f"{panel['title']} {target['refId']}") for panel, target in targets(load())
]


@pytest.mark.parametrize("expr", DASHBOARD_QUERIES)
def test_dashboard_query_evaluates(prometheus, expr):
    body = query(prometheus, expr)
    assert body["status"] == "success" and "error" not in body, body
