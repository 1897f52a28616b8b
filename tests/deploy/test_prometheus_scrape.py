"""A real Prometheus, configured like deploy/prometheus/prometheus.yml with ardit's rules loaded, scrapes
the real pair while traffic flows: every family the dashboard charts is there, every dashboard query
(its variables resolved the way Grafana does) and every rule's signal returns data, and the rules
evaluate without error.

Prometheus comes from Debian's package (`make prometheus`; `make test` runs it first).
"""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from tests.conftest import ADMIN_TOKEN, API_KEY, Stack
from tests.deploy.dashboard import (
    CHARTED_FAMILIES,
    CUDA_ONLY_FAMILIES,
    ROOT,
    all_values,
    expand,
    load,
    metric_names,
    targets,
)
from tests.deploy.prometheus_rules import ALERT_EXPR, RULE_FILES, rules
from tests.support.ports import free_port
from tests.support.waiting import holds_within

pytestmark = pytest.mark.slow

STARTUP_SECONDS = 60.0
SCRAPE_WAIT_SECONDS = 60.0
# What Grafana puts in for its own variables: a rate window of a few 1 s scrapes, the default range.
GRAFANA_BUILTINS = {"__rate_interval": "1m", "__range": "30m"}
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Image requests of the traffic: plain, with CFG, and one that generates tokens (inter-token latency).
IMAGE_REQUESTS = (
    {"prompt": "a red cube", "size": "64x64", "num_inference_steps": 2},
    {"prompt": "a blue cube", "size": "64x64", "num_inference_steps": 2, "guidance_scale": 2.0},
    {"prompt": "a green cube", "size": "64x64", "num_inference_steps": 2, "max_new_tokens": 4},
)


def scrape_config(stack: Stack) -> dict:
    """The shipped config, with the compose targets swapped for the loopback services (the stack's AR has
    API keys and no internal port, so its public /metrics takes the admin token), the rules read from the
    repository, and a 1 s scrape so the test waits seconds, not minutes."""
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(path) for path in RULE_FILES]
    addresses = {"ardit-ar": urlsplit(stack.ar.url).netloc, "ardit-dit": urlsplit(stack.dit.url).netloc}
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [addresses[job["job_name"]]]}]
        if job["job_name"] == "ardit-ar":
            job["authorization"] = {"credentials": ADMIN_TOKEN}
    return config


def wait_for(condition, timeout: float, what: str, log: Path | None = None) -> None:
    """Looks every 0.5 s (each look is a query of the Prometheus server, which scrapes every 1 s)."""
    if not holds_within(condition, timeout, every=0.5):
        pytest.fail(f"timed out waiting for {what}" + (f"; prometheus log:\n{log.read_text()[-4000:]}" if log else ""))


def send_traffic(stack: Stack) -> int:
    """Image requests, and requests each service refuses before any route handler runs."""
    for body in IMAGE_REQUESTS:
        response = httpx.post(f"{stack.api_base}/images/generations", headers=AUTH, json=body, timeout=300)
        assert response.status_code == 200, response.text
    refused = [
        httpx.post(f"{stack.api_base}/images/generations", json=IMAGE_REQUESTS[0]),  # no API key
        httpx.post(f"{stack.api_base}/images/generations", headers=AUTH, json={"prompt": 7}),
        httpx.get(f"{stack.api_base}/models/no-such-model", headers=AUTH),
        httpx.get(f"{stack.ar.url}/no/such/path", headers=AUTH),
        httpx.post(f"{stack.dit.url}/v1/handoff", content=b""),  # no handoff token
    ]
    assert [r.status_code for r in refused] == [401, 400, 404, 404, 401]
    return len(IMAGE_REQUESTS)


@pytest.fixture(scope="module")
def prometheus(stack: Stack, tmp_path_factory) -> Iterator[httpx.Client]:
    """Prometheus scraping the pair from before the traffic to after it (rates need both sides)."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("the prometheus binary is missing: run `make prometheus` (make test does)")
    # A counter series born between two scrapes shows up with its final value, and increase() over it is 0: on a
    # fresh, fast pair the whole traffic could land between two 1 s scrapes. One request first gives every
    # traffic series a sample before it.
    warm_up = httpx.post(f"{stack.api_base}/images/generations", headers=AUTH, json=IMAGE_REQUESTS[0], timeout=300)
    assert warm_up.status_code == 200, warm_up.text
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
        wait_for(lambda: len(values(client, "up == 1")) == 2, SCRAPE_WAIT_SECONDS, "a first scrape of both", log)
        before = requests_seen(client)
        sent = send_traffic(stack)
        wait_for(lambda: requests_seen(client) >= before + sent, SCRAPE_WAIT_SECONDS, "a scrape after traffic", log)
        # rate() needs two samples after the traffic in its window; a few 1 s scrapes more give it them.
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


def values(client: httpx.Client, promql: str) -> list[float]:
    body = query(client, promql)
    assert body["status"] == "success" and "error" not in body, (promql, body)
    return [float(sample["value"][1]) for sample in body["data"]["result"]]


def requests_seen(client: httpx.Client) -> float:
    return sum(values(client, 'ardit_ar_requests_total{status="ok"}'))


def label_values(client: httpx.Client) -> Callable[[str, str], list[str]]:
    """What Grafana's ``label_values(selector, label)`` asks Prometheus."""

    def lookup(selector: str, label: str) -> list[str]:
        body = client.get(f"/api/v1/label/{label}/values", params={"match[]": selector}).json()
        assert body["status"] == "success", body
        return body["data"]

    return lookup


def scraped_from(family: str) -> set[str]:
    if family.startswith("process_"):
        return {"ardit-ar", "ardit-dit"}
    return {"ardit-dit"} if family.startswith("ardit_dit_") else {"ardit-ar"}


def test_both_services_are_scraped_up(prometheus):
    active = prometheus.get("/api/v1/targets").json()["data"]["activeTargets"]
    assert {(t["labels"]["job"], t["health"]) for t in active} == {("ardit-ar", "up"), ("ardit-dit", "up")}


@pytest.mark.parametrize("family", CHARTED_FAMILIES)
def test_charted_family_is_scraped_from_its_service(prometheus, family):
    body = prometheus.get("/api/v1/series", params={"match[]": f'{{__name__="{family}"}}'}).json()
    assert body["status"] == "success", body
    assert {series["job"] for series in body["data"]} == scraped_from(family)


DASHBOARD_QUERIES = [
    pytest.param(target["expr"], id=f"{panel['title']} {target['refId']}") for panel, target in targets(load())
]


@pytest.mark.parametrize("expr", DASHBOARD_QUERIES)
def test_dashboard_query_returns_data_after_traffic(prometheus, expr):
    resolved = expand(expr, all_values(label_values(prometheus), load(), GRAFANA_BUILTINS))
    found = values(prometheus, resolved)
    if metric_names(expr) & CUDA_ONLY_FAMILIES:
        assert found == []  # the test pair's DiT runs on CPU: no GPU memory to report
    else:
        assert any(math.isfinite(value) for value in found), resolved


def test_rules_are_loaded_and_evaluate_without_error(prometheus):
    def loaded() -> list[dict]:
        groups = prometheus.get("/api/v1/rules").json()["data"]["groups"]
        return [rule for group in groups for rule in group["rules"]]

    # A rule not evaluated yet reports the zero time.
    wait_for(
        lambda: all(not r["lastEvaluation"].startswith("0001") for r in loaded()),
        SCRAPE_WAIT_SECONDS,
        "every rule to be evaluated",
    )
    rules_loaded = loaded()
    assert len(rules_loaded) == len(rules("record")) + len(rules("alert"))
    assert all(rule["health"] == "ok" and not rule.get("lastError") for rule in rules_loaded), rules_loaded


@pytest.mark.parametrize("rule", rules("record"), ids=lambda rule: rule["record"])
def test_recorded_signal_has_data_after_traffic(prometheus, rule):
    assert any(math.isfinite(value) for value in values(prometheus, rule["expr"])), rule["expr"]
    assert values(prometheus, rule["record"]), f"{rule['record']} was not recorded"


@pytest.mark.parametrize("rule", rules("alert"), ids=lambda rule: rule["alert"])
def test_alert_signal_has_data_after_traffic(prometheus, rule):
    parsed = ALERT_EXPR.fullmatch(rule["expr"].strip())
    assert parsed is not None, rule["expr"]
    signal = parsed.group("signal")
    assert any(math.isfinite(value) for value in values(prometheus, signal)), signal
    values(prometheus, rule["expr"])  # and the comparison itself evaluates
