"""docker-compose.yml (alone, and merged with docker-compose.cpu.yml) as the real Compose v2 binary reads it
(`docker compose config`: parsed, merged, interpolated and validated against the Compose Specification), plus
the properties the deployments rely on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from ar_service.settings import ArSettings
from dit_service.settings import DitSettings
from services.model_card import QWEN_IMAGE
from shared.diffusion import parse_size
from tests.deploy.compose_cli import CPU_FILES, GPU_FILES, ROOT, compose, rendered

GPU_SERVICES = {"ar": "0", "dit": "1"}
PORTS = {"ar": 8000, "dit": 8001}
MODEL_HOST_DIRS = {"ar": "/srv/models/ar", "dit": "/srv/models/dit"}
CACHE_VARIABLES = ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "HF_HOME")
GPU_CACHE_VARIABLES = ("FLASHINFER_WORKSPACE_BASE", "CUDA_CACHE_PATH")
DRAIN_VARIABLES = {"ar": "ARDIT_AR_DRAIN_SECONDS", "dit": "ARDIT_DIT_DRAIN_SECONDS"}
# What a service needs between its drain's end and Compose's SIGKILL: closing the engine and exiting.
DRAIN_MARGIN_SECONDS = 10


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """What an operator sets: the model directories and the handoff env file (made from the shipped example)."""
    env_file = tmp_path_factory.mktemp("compose") / "handoff.env"
    env_file.write_text((ROOT / "deploy" / "handoff.env.example").read_text())
    return {
        "ARDIT_AR_MODEL_HOST_DIR": MODEL_HOST_DIRS["ar"],
        "ARDIT_DIT_MODEL_HOST_DIR": MODEL_HOST_DIRS["dit"],
        "ARDIT_HANDOFF_ENV_FILE": str(env_file),
    }


@pytest.fixture(scope="module")
def gpu(env) -> dict:
    return rendered(GPU_FILES, env)


@pytest.fixture(scope="module")
def cpu(env) -> dict:
    return rendered(CPU_FILES, env)


@pytest.fixture(params=["gpu", "cpu"])
def variant(request) -> dict:
    return request.getfixturevalue(request.param)


def seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration))


def drain_shortfalls(config: dict) -> list[str]:
    """Services Compose would SIGKILL before their drain (ARDIT_*_DRAIN_SECONDS) and exit are over."""
    shortfalls = []
    for name, variable in DRAIN_VARIABLES.items():
        service = config["services"][name]
        drain = float(service["environment"][variable])
        grace = seconds(service.get("stop_grace_period", "10s"))  # Compose's default
        if grace < drain + DRAIN_MARGIN_SECONDS:
            shortfalls.append(f"{name}: {grace:g} s to stop, {drain:g} s of drain")
    return shortfalls


def dockerfile(service: dict) -> str:
    return (Path(service["build"]["context"]) / service["build"]["dockerfile"]).read_text()


def image_env(text: str) -> dict[str, str]:
    """The ENV a Dockerfile's last stage sets (``KEY=value`` pairs, continuation lines joined)."""
    last_stage = re.split(r"^FROM\s", text, flags=re.MULTILINE)[-1].replace("\\\n", " ")
    pairs = [p for line in re.findall(r"^ENV\s+(.*)$", last_stage, re.MULTILINE) for p in line.split()]
    return dict(pair.split("=", 1) for pair in pairs)


def test_compose_rejects_a_misplaced_attribute(env, tmp_path):
    override = tmp_path / "broken.yml"
    override.write_text("services:\n  dit:\n    healthcheck:\n      start_periods: 600s\n")
    result = compose((*GPU_FILES, str(override)), "config", env=env, check=False)
    assert result.returncode != 0 and "start_periods" in result.stderr


def test_compose_refuses_to_run_without_the_model_directories(env):
    result = compose(CPU_FILES, "config", env={**env, "ARDIT_AR_MODEL_HOST_DIR": ""}, check=False)
    assert result.returncode != 0 and "set ARDIT_AR_MODEL_HOST_DIR" in result.stderr


def test_each_gpu_service_reserves_its_own_nvidia_gpu(gpu):
    for name, device_id in GPU_SERVICES.items():
        (device,) = gpu["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["device_ids"] == [device_id]
        assert device["capabilities"] == ["gpu"]


def test_cpu_variant_reserves_no_gpu_and_runs_on_cpu(cpu):
    for name in GPU_SERVICES:
        service = cpu["services"][name]
        assert "deploy" not in service
        assert service["build"]["dockerfile"] == "deploy/docker/Dockerfile.cpu" and service["image"] == "ardit:cpu"
    assert "ARDIT_AR_DTYPE" not in cpu["services"]["ar"]["environment"]  # bf16 where the CPU multiplies it
    assert cpu["services"]["dit"]["environment"]["ARDIT_DIT_DEVICE"] == "cpu"


def test_gpu_variant_serves_qwen_image_as_published_and_cpu_keeps_the_demo_defaults(gpu, cpu, monkeypatch):
    gpu_env, cpu_env = gpu["services"]["ar"]["environment"], cpu["services"]["ar"]["environment"]
    gpu_dit, cpu_dit = gpu["services"]["dit"]["environment"], cpu["services"]["dit"]["environment"]
    assert int(gpu_env["ARDIT_AR_KV_CACHE_BYTES"]) >= 8 << 30
    # Qwen-Image's layer, steps, size and CFG come from its folder (its model card), bf16 from the GPU: not set.
    assert not {"ARDIT_AR_DTYPE", "ARDIT_AR_HIDDEN_LAYER", "ARDIT_AR_DEFAULT_NEGATIVE_PROMPT"} & set(gpu_env)
    model_defaults = {"ARDIT_DIT_DTYPE", "ARDIT_DIT_DEFAULT_SIZE", "ARDIT_DIT_DEFAULT_NUM_INFERENCE_STEPS"}
    assert not (model_defaults | {"ARDIT_DIT_DEFAULT_GUIDANCE_SCALE"}) & set(gpu_dit)
    # The CPU override drops the GPU sizes, so the services' own (demo) defaults apply.
    assert "ARDIT_AR_KV_CACHE_BYTES" not in cpu_env and "ARDIT_DIT_SIZES" not in cpu_dit
    for key in list(gpu_env) + list(gpu_dit):
        monkeypatch.delenv(key, raising=False)
    assert ArSettings().kv_cache_bytes is None  # sized in tokens, for the demo's short prompts
    assert ArSettings().hidden_layer is None  # the model card's (a Qwen-Image folder's), else the demo DiT's
    assert DitSettings().default_size is None  # the model card's (or 256x256), the demo's size
    assert DitSettings().sizes is None  # the model card's list


def test_gpu_variant_lists_qwen_images_sizes_with_its_default_first_and_openais_usual_ones(gpu, monkeypatch):
    environment = gpu["services"]["dit"]["environment"]
    for key, value in environment.items():
        monkeypatch.setenv(key, str(value))
    settings = DitSettings()
    assert settings.sizes is not None and settings.sizes[0] == QWEN_IMAGE.default_size
    assert {"1664x928", "928x1664", "1024x1024", "1536x1024", "1024x1536"} <= set(settings.sizes)
    for size in settings.sizes:
        width, height = parse_size(size)
        assert width % 16 == 0 and height % 16 == 0 and width * height <= settings.max_pixels, size


def test_services_are_healthy_only_when_ready(variant):
    for name, port in PORTS.items():
        check = variant["services"][name]["healthcheck"]
        assert check["test"][0] == "CMD-SHELL" and len(check["test"]) == 2
        assert f"urlopen('http://127.0.0.1:{port}/readyz'" in check["test"][1]
        # Engine start-up and warm-up take minutes on a cold GPU host.
        assert seconds(check["start_period"]) >= 300


def test_the_image_api_is_published_on_loopback_unless_told_otherwise(variant, env):
    services = variant["services"]
    (port,) = services["ar"]["ports"]
    assert (port["host_ip"], port["published"], port["target"]) == ("127.0.0.1", "8000", 8000)
    assert "ports" not in services["dit"] and "ports" not in services["prometheus"]
    assert all(p["host_ip"] == "127.0.0.1" for p in services["grafana"]["ports"])
    exposed = rendered(CPU_FILES, {**env, "ARDIT_AR_PUBLISH_ADDRESS": "0.0.0.0", "ARDIT_AR_PUBLISH_PORT": "9000"})
    (port,) = exposed["services"]["ar"]["ports"]
    assert (port["host_ip"], port["published"]) == ("0.0.0.0", "9000")


def test_compose_waits_for_each_service_to_drain_before_killing_it(variant):
    for name, variable in DRAIN_VARIABLES.items():
        assert float(variant["services"][name]["environment"][variable]) == 150
        assert seconds(variant["services"][name]["stop_grace_period"]) == 180
    assert drain_shortfalls(variant) == []


def test_a_stop_grace_period_shorter_than_the_drain_is_caught(env, tmp_path):
    override = tmp_path / "impatient.yml"
    override.write_text("services:\n  dit:\n    stop_grace_period: 60s\n")
    config = rendered((*GPU_FILES, str(override)), env)
    assert drain_shortfalls(config) == ["dit: 60 s to stop, 150 s of drain"]


def test_ar_starts_after_the_dit_is_healthy(variant):
    assert variant["services"]["ar"]["depends_on"]["dit"]["condition"] == "service_healthy"


def test_services_restart_when_they_exit(variant):
    for name in (*GPU_SERVICES, "prometheus"):
        assert variant["services"][name]["restart"] == "unless-stopped"


def test_models_are_mounted_read_only_where_the_settings_point(variant):
    for name, variable in (("ar", "ARDIT_AR_MODEL_DIR"), ("dit", "ARDIT_DIT_MODEL_DIR")):
        service = variant["services"][name]
        (mount,) = [v for v in service["volumes"] if v["target"] == service["environment"][variable]]
        assert mount["type"] == "bind" and mount["read_only"] is True
        assert mount["source"] == MODEL_HOST_DIRS[name]


def test_compile_caches_live_on_a_volume_the_image_points_them_to(variant):
    for name in GPU_SERVICES:
        service = variant["services"][name]
        (cache,) = [v for v in service["volumes"] if v["target"] == "/cache"]
        assert cache["type"] == "volume" and cache["source"] in variant["volumes"]
        environment = image_env(dockerfile(service))
        assert all(environment[key].startswith("/cache/") for key in CACHE_VARIABLES)
    if variant["services"]["ar"]["image"].endswith(":gpu"):
        for key in GPU_CACHE_VARIABLES:
            assert environment[key].startswith("/cache/"), key


@pytest.mark.parametrize("name", list(GPU_SERVICES))
def test_images_never_reach_for_a_model_hub(variant, name):
    assert image_env(dockerfile(variant["services"][name]))["HF_HUB_OFFLINE"] == "1"


def test_handoff_token_comes_from_the_env_file_whose_example_ships(env):
    example = (ROOT / "deploy" / "handoff.env.example").read_text()
    assert re.search(r"^ARDIT_HANDOFF_TOKEN=\S+$", example, re.MULTILINE)
    assert "cp deploy/handoff.env.example deploy/handoff.env" in example
    source = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name in GPU_SERVICES:
        assert source["services"][name]["env_file"] == "${ARDIT_HANDOFF_ENV_FILE:-deploy/handoff.env}"
        assert "ARDIT_HANDOFF_TOKEN" not in source["services"][name]["environment"]
    found = re.search(r"^ARDIT_HANDOFF_TOKEN=(\S+)$", example, re.MULTILINE)
    assert found is not None
    token = found.group(1)
    assert rendered(GPU_FILES, env)["services"]["dit"]["environment"]["ARDIT_HANDOFF_TOKEN"] == token
    assert (ROOT / ".gitignore").read_text().count("deploy/handoff.env") == 1
    assert "deploy/handoff.env" in (ROOT / ".dockerignore").read_text().split()


@pytest.mark.parametrize("name, settings_class", [("ar", ArSettings), ("dit", DitSettings)])
def test_environment_is_valid_settings(variant, name, settings_class, monkeypatch):
    """Every ARDIT_* variable names a real setting and parses as the service will parse it."""
    environment = variant["services"][name]["environment"]
    prefix = settings_class.model_config["env_prefix"]
    for key, value in environment.items():
        if key != "ARDIT_HANDOFF_TOKEN":  # the shared token, read by both under its own name
            assert key.startswith(prefix) and key[len(prefix) :].lower() in settings_class.model_fields, key
        monkeypatch.setenv(key, value)
    settings = settings_class()
    assert settings.host == "0.0.0.0" and settings.port == PORTS[name]


def test_ar_reaches_the_dit_by_its_service_name(variant):
    assert variant["services"]["ar"]["environment"]["ARDIT_AR_DIT_URL"] == f"http://dit:{PORTS['dit']}"


def test_service_images_build_from_dockerfiles_that_run_unprivileged(variant):
    for name in (*GPU_SERVICES, "prometheus"):
        service = variant["services"][name]
        users = re.findall(r"^USER\s+(\S+)", dockerfile(service), re.MULTILINE)
        assert users and users[-1] not in ("root", "0")
    for name in GPU_SERVICES:
        assert variant["services"][name]["command"] == ["python", "-m", f"{name}_service"]


def test_prometheus_scrapes_the_dit_and_the_ars_unpublished_internal_port_by_compose_name(gpu):
    prometheus = gpu["services"]["prometheus"]
    (config_mount,) = [v for v in prometheus["volumes"] if v["target"] == "/etc/prometheus/prometheus.yml"]
    assert config_mount["read_only"] is True
    config = yaml.safe_load(Path(config_mount["source"]).read_text())
    jobs = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    internal = gpu["services"]["ar"]["environment"]["ARDIT_AR_INTERNAL_PORT"]
    assert jobs == {"ardit-ar": [f"ar:{internal}"], "ardit-dit": [f"dit:{PORTS['dit']}"]}
    assert internal in gpu["services"]["ar"]["expose"]
    assert [p["target"] for p in gpu["services"]["ar"]["ports"]] == [PORTS["ar"]]  # never published
    assert config["global"]["scrape_interval"] == "5s"


def test_third_party_images_are_pinned(gpu):
    assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", gpu["services"]["grafana"]["image"])
