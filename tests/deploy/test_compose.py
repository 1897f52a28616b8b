"""docker-compose.yml (and it merged with docker-compose.cpu.yml) against the Compose Specification,
plus the properties the two-GPU deployment relies on.

No Docker engine runs here, so the schema stands in for `docker compose config`:
compose-spec.json is the Compose Specification's schema (Apache-2.0, compose-spec.LICENSE beside it),
as vendored by the PyPI package check-jsonschema 0.39.0 (check_jsonschema/builtin_schemas/vendor/).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from ar_service.settings import ArSettings
from dit_service.settings import DitSettings

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((Path(__file__).parent / "compose-spec.json").read_text())
GPU_SERVICES = {"ar": "0", "dit": "1"}
PORTS = {"ar": 8000, "dit": 8001}


class _Reset:
    """Compose's ``!reset`` tag: the override removes the attribute."""


RESET = _Reset()


class ComposeLoader(yaml.SafeLoader):
    pass


ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)


def load(name: str) -> dict:
    return yaml.load((ROOT / name).read_text(), Loader=ComposeLoader)


def merge(base: dict, override: dict) -> dict:
    """Compose's merge for what an override of ours uses: mappings merge key by key, ``!reset``
    removes, anything else replaces. (Compose appends some sequences, e.g. ports; the CPU override
    sets none.)"""
    merged = dict(base)
    for key, value in override.items():
        if value is RESET:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def interpolate(value: str) -> str:
    """``${VAR:-default}`` with VAR unset: the default (what a bare `docker compose up` gets)."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)


def seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration))


GPU = load("docker-compose.yml")
CPU = merge(GPU, load("docker-compose.cpu.yml"))
VARIANTS = pytest.mark.parametrize("compose", [GPU, CPU], ids=["gpu", "cpu"])


def test_schema_is_the_compose_specification():
    jsonschema.validators.validator_for(SCHEMA).check_schema(SCHEMA)
    assert SCHEMA["title"] == "Compose Specification"


def schema_errors(compose: dict) -> list[str]:
    validator = jsonschema.validators.validator_for(SCHEMA)(SCHEMA)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]


@VARIANTS
def test_valid_against_the_compose_specification(compose):
    assert schema_errors(compose) == []


def test_schema_catches_a_misplaced_attribute():
    broken = merge(GPU, {"services": {"dit": {"healthcheck": {"start_periods": "600s"}}}})
    assert any("start_periods" in error for error in schema_errors(broken))


def test_each_gpu_service_reserves_its_own_nvidia_gpu():
    for name, device_id in GPU_SERVICES.items():
        devices = GPU["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "device_ids": [device_id], "capabilities": ["gpu"]}]
    assert len(set(GPU_SERVICES.values())) == len(GPU_SERVICES)


def test_cpu_variant_reserves_no_gpu_and_runs_on_cpu():
    for name in GPU_SERVICES:
        service = CPU["services"][name]
        assert "deploy" not in service
        assert service["build"]["dockerfile"] == "deploy/docker/Dockerfile.cpu"
    assert CPU["services"]["ar"]["environment"]["ARDIT_AR_DTYPE"] == "float32"
    assert CPU["services"]["dit"]["environment"]["ARDIT_DIT_DEVICE"] == "cpu"


@VARIANTS
def test_services_are_healthy_only_when_ready(compose):
    for name, port in PORTS.items():
        check = compose["services"][name]["healthcheck"]
        assert check["test"][0] == "CMD"
        assert f"127.0.0.1:{port}/readyz" in " ".join(check["test"])
        # Engine start-up and warm-up take minutes on a cold GPU host.
        assert seconds(check["start_period"]) >= 300


@VARIANTS
def test_only_the_public_api_is_published(compose):
    services = compose["services"]
    assert services["ar"]["ports"] == ["8000:8000"]
    assert "ports" not in services["dit"]
    assert "ports" not in services["prometheus"]
    assert all(p.startswith("127.0.0.1:") for p in services["grafana"]["ports"])


def test_ar_starts_after_the_dit_is_healthy():
    assert GPU["services"]["ar"]["depends_on"] == {"dit": {"condition": "service_healthy"}}


@VARIANTS
def test_models_are_mounted_read_only_where_the_settings_point(compose):
    for name, variable in (("ar", "ARDIT_AR_MODEL_DIR"), ("dit", "ARDIT_DIT_MODEL_DIR")):
        service = compose["services"][name]
        (mount,) = [v for v in service["volumes"] if v["target"] == service["environment"][variable]]
        assert mount["type"] == "bind" and mount["read_only"] is True
        assert mount["source"].startswith(f"${{ARDIT_{name.upper()}_MODEL_HOST_DIR:?")


def test_handoff_token_comes_from_the_env_file_whose_example_ships():
    example = (ROOT / "deploy" / "handoff.env.example").read_text()
    assert re.search(r"^ARDIT_HANDOFF_TOKEN=\S+$", example, re.MULTILINE)
    assert "cp deploy/handoff.env.example deploy/handoff.env" in example
    for name in GPU_SERVICES:
        assert GPU["services"][name]["env_file"] == "deploy/handoff.env"
        assert "ARDIT_HANDOFF_TOKEN" not in GPU["services"][name]["environment"]


@VARIANTS
@pytest.mark.parametrize("name, settings_class", [("ar", ArSettings), ("dit", DitSettings)])
def test_environment_is_valid_settings(compose, name, settings_class, monkeypatch):
    """Every ARDIT_* variable names a real setting and parses as the service will parse it."""
    environment = compose["services"][name]["environment"]
    prefix = settings_class.model_config["env_prefix"]
    for key, value in environment.items():
        assert key.startswith(prefix) and key[len(prefix) :].lower() in settings_class.model_fields, key
        monkeypatch.setenv(key, interpolate(str(value)))
    settings = settings_class()
    assert settings.host == "0.0.0.0" and settings.port == PORTS[name]


def test_ar_reaches_the_dit_by_its_service_name():
    assert GPU["services"]["ar"]["environment"]["ARDIT_AR_DIT_URL"] == f"http://dit:{PORTS['dit']}"


@VARIANTS
def test_service_images_build_from_dockerfiles_that_run_unprivileged(compose):
    for name in GPU_SERVICES:
        service = compose["services"][name]
        assert service["command"] == ["python", "-m", f"{name}_service"]
        dockerfile = (ROOT / service["build"]["context"] / service["build"]["dockerfile"]).read_text()
        users = re.findall(r"^USER\s+(\S+)", dockerfile, re.MULTILINE)
        assert users and users[-1] not in ("root", "0")


def test_prometheus_scrapes_both_services_by_compose_name():
    prometheus = GPU["services"]["prometheus"]
    source, target, mode = prometheus["volumes"][0].split(":")
    assert target == "/etc/prometheus/prometheus.yml" and mode == "ro"
    config = yaml.safe_load((ROOT / source).read_text())
    jobs = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    assert jobs == {"ardit-ar": [f"ar:{PORTS['ar']}"], "ardit-dit": [f"dit:{PORTS['dit']}"]}
    assert config["global"]["scrape_interval"] == "5s"


@pytest.mark.parametrize("image", ["prometheus", "grafana"])
def test_third_party_images_are_pinned(image):
    assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", GPU["services"][image]["image"])
