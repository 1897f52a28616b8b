"""deploy/kubernetes/ checked offline: what `kubectl apply -k deploy/kubernetes` would send, against the
Kubernetes API schemas and the CRD schemas of the add-ons it needs, plus the references between objects.

Nothing here talks to a cluster. The kustomization is rendered the way kustomize would for what it uses
(every resource file, the namespace, the Secret generated from handoff.env, for which the committed
deploy/handoff.env.example stands in; the generated name's hash suffix is left out, since kustomize
rewrites every reference to it). Core objects are checked with kubernetes-validate's schemas for
Kubernetes KUBERNETES_VERSION in strict mode (unknown fields are errors). Custom resources are checked
against the openAPIV3Schema of the served version in the add-on's published CRD (tests/deploy/schemas/,
sources in SOURCES.md there) with unknown fields made errors, as kubectl's default strict field validation
makes them; their CEL rules (x-kubernetes-validations) are not evaluated. The endpoint picker's own
configuration file is checked against endpointpickerconfig.schema.json, written for ardit from
llm-d-router v0.10.0's Go types (that project publishes no schema).
"""

from __future__ import annotations

import base64
import copy
import json
import re
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from ar_service.settings import ArSettings
from dit_service.settings import DitSettings

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE_DIR = ROOT / "deploy" / "kubernetes"
SCHEMAS = Path(__file__).parent / "schemas"
KUBERNETES_VERSION = "1.33"
# kustomize's secretGenerator reads deploy/kubernetes/handoff.env, which is not committed.
GENERATOR_ENV_STAND_INS = {"handoff.env": ROOT / "deploy" / "handoff.env.example"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
CRD_FILES = {
    ("inference.networking.k8s.io", "InferencePool"): "inference.networking.k8s.io_inferencepools.yaml",
    ("gateway.networking.k8s.io", "HTTPRoute"): "gateway.networking.k8s.io_httproutes.yaml",
    ("monitoring.coreos.com", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
    ("keda.sh", "ScaledObject"): "keda.sh_scaledobjects.yaml",
}
EPP_SCHEMA = json.loads((Path(__file__).parent / "endpointpickerconfig.schema.json").read_text())
PORTS = {"ar": 8000, "dit": 8001}


def env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


def render(kustomization_dir: Path = KUSTOMIZE_DIR) -> list[dict]:
    kustomization = yaml.safe_load((kustomization_dir / "kustomization.yaml").read_text())
    objects = [
        obj
        for resource in kustomization["resources"]
        for obj in yaml.safe_load_all((kustomization_dir / resource).read_text())
        if obj
    ]
    for generator in kustomization.get("secretGenerator", []):
        data: dict[str, str] = {}
        for name in generator["envs"]:
            data |= env_file(GENERATOR_ENV_STAND_INS[name])
        encoded = {key: base64.b64encode(value.encode()).decode() for key, value in data.items()}
        secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "data": encoded}
        objects.append(secret | {"metadata": {"name": generator["name"]}})
    for obj in objects:
        if obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = kustomization["namespace"]
    return objects


OBJECTS = render()
NAMESPACE = yaml.safe_load((KUSTOMIZE_DIR / "kustomization.yaml").read_text())["namespace"]


def the(kind: str, name: str, objects: list[dict] = OBJECTS) -> dict:
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def of_kind(kind: str, objects: list[dict] = OBJECTS) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def group_of(obj: dict) -> str:
    return obj["apiVersion"].rpartition("/")[0]


def is_custom(obj: dict) -> bool:
    return (group_of(obj), obj["kind"]) in CRD_FILES


def object_id(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels plus In/NotIn/Exists/DoesNotExist expressions, or a plain Service map)."""
    match_labels = selector.get("matchLabels", {} if "matchExpressions" in selector else selector)
    if any(labels.get(key) != value for key, value in match_labels.items()):
        return False
    tests = {
        "In": lambda e: labels.get(e["key"]) in e["values"],
        "NotIn": lambda e: labels.get(e["key"]) not in e["values"],
        "Exists": lambda e: e["key"] in labels,
        "DoesNotExist": lambda e: e["key"] not in labels,
    }
    return all(tests[e["operator"]](e) for e in selector.get("matchExpressions", []))


def pods_selected(selector: dict) -> list[dict]:
    return [d for d in of_kind("Deployment") if selects(selector, d["spec"]["template"]["metadata"]["labels"])]


def containers(deployment: dict) -> list[dict]:
    return deployment["spec"]["template"]["spec"]["containers"]


def container_ports(deployment: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in containers(deployment) for p in c.get("ports", [])}


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def tier(component: str) -> dict:
    (deployment,) = [
        d
        for d in of_kind("Deployment")
        if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    return deployment


# --- schemas -----------------------------------------------------------------------------------------


def core_validation_error(obj: dict) -> str | None:
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        return f"{object_id(obj)} {'.'.join(map(str, error.path))}: {error.message}"
    return None


def closed(schema: object) -> object:
    """The schema with unknown fields made errors wherever the CRD lists the fields and does not keep
    unknown ones (the API server's strict field validation, kubectl's default)."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: closed(value) for key, value in schema.items()}
    keeps_unknown = schema.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in schema
    if "properties" in schema and not keeps_unknown:
        result["additionalProperties"] = False
    return result


def crd_schema(group: str, kind: str, version: str) -> dict:
    path = SCHEMAS / CRD_FILES[(group, kind)]
    if not path.exists():
        pytest.skip(f"{path.relative_to(ROOT)} is not present (see tests/deploy/schemas/SOURCES.md)")
    crd = yaml.safe_load(path.read_text())
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    schema = closed(served["schema"]["openAPIV3Schema"])
    assert isinstance(schema, dict)
    return schema


def custom_validation_errors(obj: dict) -> list[str]:
    schema = crd_schema(group_of(obj), obj["kind"], obj["apiVersion"].rpartition("/")[2])
    # The CRD schemas are OpenAPI 3.0 structural schemas: JSON Schema draft 4 keywords.
    validator = jsonschema.Draft4Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def epp_config(objects: list[dict] = OBJECTS) -> dict:
    deployment = the("Deployment", "ardit-ar-epp", objects)
    args = containers(deployment)[0]["args"]
    config_path = Path(args[args.index("--config-file") + 1])
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
    config_map = the("ConfigMap", volume["configMap"]["name"], objects)
    return yaml.safe_load(config_map["data"][config_path.name])


def epp_config_errors(config: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(EPP_SCHEMA)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(config)]


def test_the_kustomization_renders_every_object_the_deployment_needs():
    kinds = {(o["kind"], o["metadata"]["name"]) for o in OBJECTS}
    assert {
        ("Deployment", "ardit-ar"),
        ("Deployment", "ardit-dit"),
        ("Deployment", "ardit-ar-epp"),
        ("Service", "ardit-ar"),
        ("Service", "ardit-dit-headless"),
        ("Service", "ardit-ar-epp"),
        ("Secret", "ardit-handoff"),
        ("InferencePool", "ardit-ar"),
        ("HTTPRoute", "ardit-images"),
        ("ServiceMonitor", "ardit"),
        ("ScaledObject", "ardit-ar"),
        ("ScaledObject", "ardit-dit"),
        ("PodDisruptionBudget", "ardit-ar"),
        ("PodDisruptionBudget", "ardit-dit"),
    } <= kinds
    assert len(kinds) == len(OBJECTS), "two objects of one kind share a name"


@pytest.mark.parametrize("obj", [o for o in OBJECTS if not is_custom(o)], ids=object_id)
def test_core_object_is_valid_for_the_stated_kubernetes_version(obj):
    assert core_validation_error(obj) is None


@pytest.mark.parametrize("obj", [o for o in OBJECTS if is_custom(o)], ids=object_id)
def test_custom_resource_is_valid_against_its_published_crd(obj):
    assert custom_validation_errors(obj) == []


def test_epp_configuration_is_valid():
    assert epp_config_errors(epp_config()) == []


# --- the checks can fail ------------------------------------------------------------------------------


def mutated(kind: str, name: str, change) -> list[dict]:
    objects = copy.deepcopy(OBJECTS)
    change(the(kind, name, objects))
    return objects


def test_a_misspelt_core_field_fails_validation():
    def misspell(deployment):
        probe = containers(deployment)[0]["readinessProbe"]
        probe["periodSecond"] = probe.pop("periodSeconds")

    broken = the("Deployment", "ardit-ar", mutated("Deployment", "ardit-ar", misspell))
    error = core_validation_error(broken)
    assert error is not None and "periodSecond" in error


def test_a_wrongly_typed_core_field_fails_validation():
    def stringify(deployment):
        deployment["spec"]["replicas"] = "two"

    broken = the("Deployment", "ardit-dit", mutated("Deployment", "ardit-dit", stringify))
    error = core_validation_error(broken)
    assert error is not None and "'two' is not of type 'integer'" in error


@pytest.mark.parametrize(
    "kind, name, change, expected",
    [
        ("InferencePool", "ardit-ar", lambda o: o["spec"].pop("selector"), "'selector' is a required property"),
        (
            "InferencePool",
            "ardit-ar",
            lambda o: o["spec"]["endpointPickerRef"].update(failureMode="FailSometimes"),
            "FailSometimes",
        ),
        (
            "HTTPRoute",
            "ardit-images",
            lambda o: o["spec"]["rules"][0]["matches"][0]["path"].update(type="Glob"),
            "Glob",
        ),
        ("ServiceMonitor", "ardit", lambda o: o["spec"]["endpoints"][0].update(scrapeEvery="5s"), "scrapeEvery"),
        ("ScaledObject", "ardit-dit", lambda o: o["spec"].update(maxReplicaCount="eight"), "'eight'"),
    ],
    ids=[
        "pool-without-selector",
        "pool-unknown-failure-mode",
        "route-unknown-path-type",
        "servicemonitor-unknown-field",
        "scaledobject-string-count",
    ],
)
def test_a_broken_custom_resource_fails_validation(kind, name, change, expected):
    broken = the(kind, name, mutated(kind, name, change))
    assert any(expected in error for error in custom_validation_errors(broken))


def test_a_broken_epp_configuration_fails_validation():
    config = epp_config()
    (producer,) = [p for p in config["plugins"] if p["type"] == "precise-prefix-cache-producer"]
    producer["parameters"]["kvEventsConfig"]["socketPort"] = 5557
    assert any("socketPort" in error for error in epp_config_errors(config))


# --- references between objects -----------------------------------------------------------------------


@pytest.mark.parametrize("deployment", of_kind("Deployment"), ids=object_id)
def test_deployment_selector_matches_its_own_pods(deployment):
    assert selects(deployment["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("service", of_kind("Service"), ids=object_id)
def test_service_selects_exactly_one_deployment_and_its_ports_exist(service):
    (deployment,) = pods_selected(service["spec"]["selector"])
    ports = container_ports(deployment)
    for port in service["spec"]["ports"]:
        target = port["targetPort"]
        assert target in ports if isinstance(target, str) else target in ports.values()


@pytest.mark.parametrize("budget", of_kind("PodDisruptionBudget"), ids=object_id)
def test_disruption_budget_covers_one_deployment(budget):
    assert len(pods_selected(budget["spec"]["selector"])) == 1


@pytest.mark.parametrize("deployment", of_kind("Deployment"), ids=object_id)
def test_probes_use_ports_the_container_declares(deployment):
    for container in containers(deployment):
        declared = {p["name"] for p in container.get("ports", [])} | {p["containerPort"] for p in container["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in container:
                action = container[probe].get("httpGet") or container[probe].get("grpc")
                assert action["port"] in declared, (container["name"], probe)


@pytest.mark.parametrize("component", ["ar", "dit"])
def test_each_tier_has_one_gpu_per_pod_and_probes_on_its_health_endpoints(component):
    (container,) = containers(tier(component))
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    assert container["startupProbe"]["httpGet"]["path"] == "/readyz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    startup = container["startupProbe"]
    # Loading and warming a real model takes minutes.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    assert container_ports(tier(component))["http"] == PORTS[component]


def test_every_secret_reference_names_a_key_that_exists():
    secrets = {s["metadata"]["name"]: set(s["data"]) for s in of_kind("Secret")}
    references = [
        e["valueFrom"]["secretKeyRef"]
        for d in of_kind("Deployment")
        for c in containers(d)
        for e in c.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    ]
    assert references
    for reference in references:
        assert reference["key"] in secrets[reference["name"]]


@pytest.mark.parametrize("component", ["ar", "dit"])
def test_both_tiers_read_the_handoff_token_from_the_secret(component):
    (container,) = containers(tier(component))
    token = env_of(container)["ARDIT_HANDOFF_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "ardit-handoff", "key": "ARDIT_HANDOFF_TOKEN"}


@pytest.mark.parametrize("component, settings_class", [("ar", ArSettings), ("dit", DitSettings)])
def test_environment_is_valid_settings(component, settings_class, monkeypatch):
    """Every ARDIT_* variable names a real setting and parses as the service will parse it; GPU defaults."""
    (container,) = containers(tier(component))
    prefix = settings_class.model_config["env_prefix"]
    for name, entry in env_of(container).items():
        if not name.startswith(prefix):
            continue
        assert name[len(prefix) :].lower() in settings_class.model_fields, name
        monkeypatch.setenv(name, entry["value"])
    settings = settings_class()
    assert settings.host == "0.0.0.0" and settings.port == PORTS[component]
    if component == "ar":
        assert settings.dtype == "bfloat16"
    else:
        assert settings.device == "cuda"


def test_the_ar_resolves_the_dit_pods_through_the_headless_service():
    (container,) = containers(tier("ar"))
    url = urlsplit(env_of(container)["ARDIT_AR_DIT_URL"]["value"])
    service = the("Service", url.hostname)
    assert service["spec"]["clusterIP"] == "None"
    assert pods_selected(service["spec"]["selector"]) == [tier("dit")]
    assert url.port in {p["port"] for p in service["spec"]["ports"]}


def test_the_ar_publishes_kv_events_on_the_port_the_picker_dials():
    (container,) = containers(tier("ar"))
    env = env_of(container)
    assert env["ARDIT_AR_KV_EVENTS_PUBLISHER"]["value"] == "zmq"
    endpoint = env["ARDIT_AR_KV_EVENTS_ENDPOINT"]["value"]
    (producer,) = [p for p in epp_config()["plugins"] if p["type"] == "precise-prefix-cache-producer"]
    events = producer["parameters"]["kvEventsConfig"]
    assert events["discoverPods"] is True
    assert endpoint == f"tcp://*:{events['podDiscoveryConfig']['socketPort']}"
    assert container_ports(tier("ar"))["kv-events"] == events["podDiscoveryConfig"]["socketPort"]


def test_the_inference_pool_selects_the_ar_pods_and_names_the_picker():
    pool = the("InferencePool", "ardit-ar")
    assert pods_selected(pool["spec"]["selector"]) == [tier("ar")]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [PORTS["ar"]]
    picker = pool["spec"]["endpointPickerRef"]
    service = the(picker.get("kind", "Service"), picker["name"])
    assert picker["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    assert pods_selected(service["spec"]["selector"]) == [the("Deployment", "ardit-ar-epp")]
    epp_args = containers(the("Deployment", "ardit-ar-epp"))[0]["args"]
    assert epp_args[epp_args.index("--pool-name") + 1] == pool["metadata"]["name"]
    assert epp_args[epp_args.index("--pool-group") + 1] == group_of(pool)


def test_the_picker_may_read_the_pool_and_its_pods():
    epp = the("Deployment", "ardit-ar-epp")
    account = epp["spec"]["template"]["spec"]["serviceAccountName"]
    (binding,) = [b for b in of_kind("RoleBinding") if b["subjects"] == [{"kind": "ServiceAccount", "name": account}]]
    rules = the("Role", binding["roleRef"]["name"])["rules"]

    def allowed(group: str, resource: str) -> bool:
        return any(group in r["apiGroups"] and resource in r["resources"] and "watch" in r["verbs"] for r in rules)

    assert allowed("", "pods") and allowed("inference.networking.k8s.io", "inferencepools")


def test_the_picker_configuration_refers_only_to_declared_plugins():
    config = epp_config()
    declared = {p.get("name") or p["type"] for p in config["plugins"]}
    profile_refs = [p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]]
    layer_refs = [
        ref
        for source in config["dataLayer"]["sources"]
        for ref in [source["pluginRef"], *(e["pluginRef"] for e in source["extractors"])]
    ]
    assert set(profile_refs + layer_refs) <= declared
    weights = {p["pluginRef"]: p.get("weight") for profile in config["schedulingProfiles"] for p in profile["plugins"]}
    assert {"prefix-cache-scorer", "kv-cache-utilization-scorer", "queue-scorer"} <= set(weights)
    (scorer,) = [p for p in config["plugins"] if p["type"] == "prefix-cache-scorer"]
    assert scorer["parameters"]["prefixMatchInfoProducerName"] in declared


def test_the_picker_tokenizes_through_the_ar_service():
    (producer,) = [p for p in epp_config()["plugins"] if p["type"] == "token-producer"]
    url = urlsplit(producer["parameters"]["vllm"]["url"])
    service = the("Service", url.hostname)
    assert pods_selected(service["spec"]["selector"]) == [tier("ar")]
    assert url.port in {p["port"] for p in service["spec"]["ports"]}
    (container,) = containers(tier("ar"))
    assert producer["parameters"]["modelName"] == env_of(container)["ARDIT_AR_SERVED_MODEL_NAME"]["value"]


def route_backends(path: str) -> list[dict]:
    route = the("HTTPRoute", "ardit-images")
    (rule,) = [r for r in route["spec"]["rules"] if any(m["path"]["value"] == path for m in r["matches"])]
    return rule["backendRefs"]


def test_json_image_requests_are_routed_to_the_inference_pool():
    (backend,) = route_backends("/v1/images/generations")
    assert (backend["group"], backend["kind"]) == ("inference.networking.k8s.io", "InferencePool")
    the("InferencePool", backend["name"])


@pytest.mark.parametrize("path", ["/v1/images/edits", "/v1/models"])
def test_requests_the_picker_cannot_parse_go_to_the_ar_service(path):
    (backend,) = route_backends(path)
    assert backend.get("group", "") == "" and backend.get("kind", "Service") == "Service"
    service = the("Service", backend["name"])
    assert backend["port"] in {p["port"] for p in service["spec"]["ports"]}
    assert pods_selected(service["spec"]["selector"]) == [tier("ar")]


def scraped_services() -> list[dict]:
    (monitor,) = of_kind("ServiceMonitor")
    ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    return [
        s
        for s in of_kind("Service")
        if selects(monitor["spec"]["selector"], s["metadata"]["labels"])
        and ports & {p["name"] for p in s["spec"]["ports"]}
    ]


def test_the_service_monitor_scrapes_both_tiers():
    names = {s["metadata"]["name"] for s in scraped_services()}
    assert names == {"ardit-ar", "ardit-dit-headless"}
    (monitor,) = of_kind("ServiceMonitor")
    assert all(e["path"] == "/metrics" for e in monitor["spec"]["endpoints"])


@pytest.mark.parametrize(
    "name, metrics",
    [
        ("ardit-ar", {"ardit_ar_requests_queued", "vllm:num_requests_waiting"}),
        ("ardit-dit", {"ardit_dit_pipeline_queue_depth"}),
    ],
)
def test_each_tier_scales_on_its_queue_as_the_service_monitor_labels_it(name, metrics):
    scaled = the("ScaledObject", name)
    the("Deployment", scaled["spec"]["scaleTargetRef"]["name"])
    scraped = {s["metadata"]["name"] for s in scraped_services()}
    queried = set()
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"] == "prometheus"
        query = trigger["metadata"]["query"]
        parsed = re.fullmatch(r"sum\(([\w:]+)\{(.*)\}\)", query)
        assert parsed is not None, query
        (metric, labels) = parsed.groups()
        selector = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        assert selector["namespace"] == NAMESPACE and selector["service"] in scraped
        pods = pods_selected(the("Service", selector["service"])["spec"]["selector"])
        assert pods == [the("Deployment", scaled["spec"]["scaleTargetRef"]["name"])]
        queried.add(metric)
    assert queried == metrics
