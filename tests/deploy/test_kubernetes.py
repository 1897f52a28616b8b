"""deploy/kubernetes/ checked offline: what `kubectl apply -k deploy/kubernetes` would send, against the
Kubernetes API schemas and the CRD schemas of the add-ons it needs, plus the references between objects.

Nothing here talks to a cluster. The kustomization is rendered the way kustomize would for what it uses
(every resource file, the namespace, the Secrets generated from handoff.env and api-keys.env, for which the
committed deploy/handoff.env.example and deploy/api-keys.env.example stand in; the generated names' hash
suffix is left out, since kustomize rewrites every reference to it). Core objects are checked with
kubernetes-validate's schemas for Kubernetes KUBERNETES_VERSION in strict mode (unknown fields are errors;
NetworkPolicy is a core object). Custom resources are checked against the openAPIV3Schema of the served
version in the add-on's published CRD (tests/deploy/schemas/, sources in SOURCES.md there) with unknown fields
made errors, as kubectl's default strict field validation makes them; their CEL rules
(x-kubernetes-validations) are not evaluated. The endpoint picker's own configuration file is checked against
endpointpickerconfig.schema.json, written for ardit from llm-d-router v0.10.0's Go types (that project
publishes no schema).

Containers' environments are resolved as the kubelet resolves them (Secret keys decoded, the downward API's
pod IP a stand-in, $(VAR) expanded from variables defined earlier only), and the NetworkPolicies are
evaluated for which pods may open a connection to which port of which tier.
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
# kustomize's secretGenerator reads deploy/kubernetes/handoff.env and api-keys.env, which are not committed.
GENERATOR_ENV_STAND_INS = {
    "handoff.env": ROOT / "deploy" / "handoff.env.example",
    "api-keys.env": ROOT / "deploy" / "api-keys.env.example",
}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
CRD_FILES = {
    ("inference.networking.k8s.io", "InferencePool"): "inference.networking.k8s.io_inferencepools.yaml",
    ("gateway.networking.k8s.io", "HTTPRoute"): "gateway.networking.k8s.io_httproutes.yaml",
    ("monitoring.coreos.com", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
    ("keda.sh", "ScaledObject"): "keda.sh_scaledobjects.yaml",
}
EPP_SCHEMA = json.loads((Path(__file__).parent / "endpointpickerconfig.schema.json").read_text())
PORTS = {"ar": 8000, "dit": 8001}
# The AR's second listener (ARDIT_AR_INTERNAL_PORT): the render endpoint, probes and metrics, no API key.
AR_INTERNAL_PORT = 8002
KV_EVENTS_PORT = 5557
REDIS_PORT = 6379
POD_IP_STAND_IN = "10.42.0.17"
# What a pod needs between its drain's end and the kubelet's SIGKILL: closing the engine and exiting.
DRAIN_MARGIN_SECONDS = 10


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


def pod_labels(deployment: dict) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def tier(component: str) -> dict:
    (deployment,) = [d for d in of_kind("Deployment") if pod_labels(d).get("app.kubernetes.io/component") == component]
    return deployment


def resolved_env(container: dict, objects: list[dict] = OBJECTS) -> dict[str, str]:
    """The environment the kubelet hands the container: Secret keys decoded, the downward API's pod IP a
    stand-in, and $(NAME) expanded only from variables defined earlier in the list (a later or unknown one
    stays as written, as the kubelet leaves it)."""
    fields = {"status.podIP": POD_IP_STAND_IN, "metadata.namespace": NAMESPACE}
    resolved: dict[str, str] = {}
    for entry in container.get("env", []):
        source = entry.get("valueFrom", {})
        if "secretKeyRef" in source:
            reference = source["secretKeyRef"]
            encoded = the("Secret", reference["name"], objects)["data"][reference["key"]]
            value = base64.b64decode(encoded).decode()
        elif "fieldRef" in source:
            value = fields[source["fieldRef"]["fieldPath"]]
        else:
            value = re.sub(r"\$\((\w+)\)", lambda m: resolved.get(m.group(1), m.group(0)), entry["value"])
        resolved[entry["name"]] = value
    return resolved


def service_target(service: dict, port: int) -> tuple[dict, int]:
    """The Deployment behind a Service port and the container port it forwards to."""
    (deployment,) = pods_selected(service["spec"]["selector"])
    (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == port]
    target = service_port.get("targetPort", port)
    return deployment, container_ports(deployment)[target] if isinstance(target, str) else target


def url_target(url: str) -> tuple[dict, int]:
    """Where an in-cluster URL (http://SERVICE:PORT, redis://SERVICE:PORT/...) lands: Deployment, container port."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None, url
    return service_target(the("Service", parts.hostname), parts.port)


def epp_plugin(plugin_type: str, config: dict | None = None) -> dict:
    (plugin,) = [p for p in (config or epp_config())["plugins"] if p["type"] == plugin_type]
    return plugin


# --- network policies ----------------------------------------------------------------------------------


def namespace_labels(namespace: str) -> dict[str, str]:
    """The label every namespace carries (Kubernetes 1.22+); the only one the policies may rely on."""
    return {"kubernetes.io/metadata.name": namespace}


def peer_admits(peer: dict, labels: dict, namespace: str) -> bool:
    if "ipBlock" in peer:  # an address range: any pod may hold an address in it
        return True
    if "namespaceSelector" in peer:
        in_namespace = selects(peer["namespaceSelector"], namespace_labels(namespace))
    else:
        in_namespace = namespace == NAMESPACE
    return in_namespace and selects(peer.get("podSelector", {}), labels)


def port_admits(rule_ports: list[dict], port: int, deployment: dict) -> bool:
    if not rule_ports:
        return True
    named = container_ports(deployment)
    for entry in rule_ports:
        if entry.get("protocol", "TCP") != "TCP":
            continue
        if "port" not in entry:
            return True
        first = named.get(entry["port"]) if isinstance(entry["port"], str) else entry["port"]
        if first is not None and first <= port <= entry.get("endPort", first):
            return True
    return False


def admits(deployment: dict, port: int, labels: dict, namespace: str, objects: list[dict] = OBJECTS) -> bool:
    """Whether a pod with these labels, in this namespace, may open a TCP connection to the Deployment's pods
    on this port: yes if no ingress policy selects them, else if some rule of one of them allows it."""
    policies = [
        p
        for p in of_kind("NetworkPolicy", objects)
        if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and selects(p["spec"]["podSelector"], pod_labels(deployment))
    ]
    if not policies:
        return True
    return any(
        port_admits(rule.get("ports", []), port, deployment)
        and (not rule.get("from") or any(peer_admits(peer, labels, namespace) for peer in rule["from"]))
        for policy in policies
        for rule in policy["spec"].get("ingress", [])
    )


def callers() -> dict[str, tuple[dict, str]]:
    """Pods that might knock, as (labels, namespace): ardit's own, the Gateway's proxy, Prometheus (as the
    Prometheus Operator labels it, in the monitoring namespace), and look-alikes in the wrong place."""
    picker = pod_labels(the("Deployment", "ardit-ar-epp"))
    prometheus = {"app.kubernetes.io/name": "prometheus", "app.kubernetes.io/managed-by": "prometheus-operator"}
    return {
        "ar": (pod_labels(tier("ar")), NAMESPACE),
        "dit": (pod_labels(tier("dit")), NAMESPACE),
        "picker": (picker, NAMESPACE),
        "redis": (pod_labels(the("Deployment", "ardit-redis")), NAMESPACE),
        "gateway": (
            {"app.kubernetes.io/name": "envoy", "gateway.networking.k8s.io/gateway-name": "inference-gateway"},
            NAMESPACE,
        ),
        "other pod here": ({"app": "debug-shell"}, NAMESPACE),
        "gateway elsewhere": ({"app.kubernetes.io/name": "envoy"}, "gateway-system"),
        "prometheus": (prometheus, "monitoring"),
        "prometheus look-alike here": (prometheus, NAMESPACE),
        "picker look-alike elsewhere": (picker, "default"),
        "ar look-alike elsewhere": (pod_labels(tier("ar")), "default"),
    }


def admitted(deployment: dict, port: int, objects: list[dict] = OBJECTS) -> set[str]:
    return {
        name for name, (labels, namespace) in callers().items() if admits(deployment, port, labels, namespace, objects)
    }


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
        ("Secret", "ardit-api-keys"),
        ("Deployment", "ardit-redis"),
        ("Service", "ardit-redis"),
        ("NetworkPolicy", "ardit-ar"),
        ("NetworkPolicy", "ardit-dit"),
        ("NetworkPolicy", "ardit-redis"),
        ("InferencePool", "ardit-ar"),
        ("HTTPRoute", "ardit-images"),
        ("ServiceMonitor", "ardit-ar"),
        ("ServiceMonitor", "ardit-dit"),
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


def test_a_misspelt_network_policy_field_fails_validation():
    def misspell(policy):
        policy["spec"]["ingres"] = policy["spec"].pop("ingress")

    broken = the("NetworkPolicy", "ardit-ar", mutated("NetworkPolicy", "ardit-ar", misspell))
    error = core_validation_error(broken)
    assert error is not None and "ingres" in error


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
        ("ServiceMonitor", "ardit-ar", lambda o: o["spec"]["endpoints"][0].update(scrapeEvery="5s"), "scrapeEvery"),
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
    producer = epp_plugin("precise-prefix-cache-producer", config)
    producer["parameters"]["kvEventsConfig"]["socketPort"] = 5557
    assert any("socketPort" in error for error in epp_config_errors(config))


@pytest.mark.parametrize(
    "parameters, expected",
    [({"metricsPort": AR_INTERNAL_PORT}, "metricsPort"), ({"port": str(AR_INTERNAL_PORT)}, "'8002'")],
    ids=["unknown-field", "string-port"],
)
def test_a_broken_metrics_source_port_fails_epp_validation(parameters, expected):
    config = epp_config()
    epp_plugin("metrics-data-source", config)["parameters"] = parameters
    assert any(expected in error for error in epp_config_errors(config))


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
                action = next(container[probe][k] for k in ("httpGet", "grpc", "tcpSocket") if k in container[probe])
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
    """Every ARDIT_* variable (as the kubelet resolves it) names a real setting and parses as the service will
    parse it; GPU defaults."""
    (container,) = containers(tier(component))
    prefix = settings_class.model_config["env_prefix"]
    for name, value in resolved_env(container).items():
        if not name.startswith(prefix):
            continue
        assert name[len(prefix) :].lower() in settings_class.model_fields, name
        monkeypatch.setenv(name, value)
    settings = settings_class()
    assert settings.host == "0.0.0.0" and settings.port == PORTS[component]
    # Qwen-Image's layer and defaults come from the folder both tiers mount (its model card), bf16 from the GPU.
    assert settings.model_dir == Path("/models/qwen-image") and settings.dtype is None
    if component == "ar":
        assert settings.hidden_layer is None
    else:
        assert settings.device == "cuda" and settings.default_size is None


def test_the_ar_resolves_the_dit_pods_through_the_headless_service():
    (container,) = containers(tier("ar"))
    url = urlsplit(env_of(container)["ARDIT_AR_DIT_URL"]["value"])
    service = the("Service", url.hostname)
    assert service["spec"]["clusterIP"] == "None"
    assert pods_selected(service["spec"]["selector"]) == [tier("dit")]
    assert url.port in {p["port"] for p in service["spec"]["ports"]}


def test_the_ar_publishes_kv_events_on_its_pod_ip_at_the_port_the_picker_dials():
    (container,) = containers(tier("ar"))
    env = env_of(container)
    assert env["ARDIT_AR_KV_EVENTS_PUBLISHER"]["value"] == "zmq"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    events = epp_plugin("precise-prefix-cache-producer")["parameters"]["kvEventsConfig"]
    assert events["discoverPods"] is True
    port = events["podDiscoveryConfig"]["socketPort"]
    # Bound to the pod's own address (not every interface), POD_IP defined before the variable that uses it.
    assert resolved_env(container)["ARDIT_AR_KV_EVENTS_ENDPOINT"] == f"tcp://{POD_IP_STAND_IN}:{port}"
    assert container_ports(tier("ar"))["kv-events"] == port == KV_EVENTS_PORT


def test_a_variable_defined_after_its_use_is_left_unexpanded():
    """The kubelet expands $(POD_IP) only from variables listed before it: the order in ar.yaml matters."""
    container = copy.deepcopy(containers(tier("ar"))[0])
    container["env"].sort(key=lambda entry: entry["name"] == "POD_IP")
    assert resolved_env(container)["ARDIT_AR_KV_EVENTS_ENDPOINT"] == f"tcp://$(POD_IP):{KV_EVENTS_PORT}"


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


def test_the_ar_listens_on_its_internal_port_as_its_settings_say():
    (container,) = containers(tier("ar"))
    env = resolved_env(container)
    assert int(env["ARDIT_AR_INTERNAL_PORT"]) == container_ports(tier("ar"))["internal"] == AR_INTERNAL_PORT
    assert int(env["ARDIT_AR_PORT"]) == container_ports(tier("ar"))["http"] != AR_INTERNAL_PORT


def test_the_picker_tokenizes_through_the_ar_service_on_the_internal_port():
    """The render endpoint needs an API key on the public port; the picker has none."""
    producer = epp_plugin("token-producer")
    deployment, port = url_target(producer["parameters"]["vllm"]["url"])
    assert deployment == tier("ar") and port == AR_INTERNAL_PORT
    (container,) = containers(tier("ar"))
    assert producer["parameters"]["modelName"] == env_of(container)["ARDIT_AR_SERVED_MODEL_NAME"]["value"]


def test_the_picker_scrapes_the_ar_metrics_on_the_internal_port():
    """The metrics source scrapes the pool's target port (the public one) unless its port says otherwise."""
    source = epp_plugin("metrics-data-source")
    assert source["parameters"]["port"] == AR_INTERNAL_PORT
    assert source["parameters"].get("path", "/metrics") == "/metrics"
    layer = {s["pluginRef"]: [e["pluginRef"] for e in s["extractors"]] for s in epp_config()["dataLayer"]["sources"]}
    assert layer[source.get("name", source["type"])] == ["core-metrics-extractor"]


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
    assert service_target(the("Service", backend["name"]), backend["port"]) == (tier("ar"), PORTS["ar"])


def test_the_gateway_reaches_the_ar_on_its_public_port_only():
    """Every pool target port is an endpoint the gateway sends requests to; no route names the internal port."""
    assert [p["number"] for p in the("InferencePool", "ardit-ar")["spec"]["targetPorts"]] == [PORTS["ar"]]
    for route in of_kind("HTTPRoute"):
        for rule in route["spec"]["rules"]:
            for backend in rule["backendRefs"]:
                if backend.get("kind", "Service") == "Service":
                    _, port = service_target(the("Service", backend["name"]), backend["port"])
                    assert port != AR_INTERNAL_PORT, object_id(route)


def scraped_endpoints() -> list[tuple[str, dict, int]]:
    """What the ServiceMonitors scrape, once per scrape: (Service name, Deployment, container port)."""
    return [
        (service["metadata"]["name"], *service_target(service, port["port"]))
        for monitor in of_kind("ServiceMonitor")
        for endpoint in monitor["spec"]["endpoints"]
        for service in of_kind("Service")
        if selects(monitor["spec"]["selector"], service["metadata"]["labels"])
        for port in service["spec"]["ports"]
        if port.get("name") == endpoint["port"]
    ]


def scraped_services() -> set[str]:
    return {name for name, _, _ in scraped_endpoints()}


def test_the_service_monitors_scrape_each_tier_once_the_ar_on_its_internal_port():
    scraped = sorted((name, deployment["metadata"]["name"], port) for name, deployment, port in scraped_endpoints())
    assert scraped == [("ardit-ar", "ardit-ar", AR_INTERNAL_PORT), ("ardit-dit-headless", "ardit-dit", PORTS["dit"])]
    assert all(e["path"] == "/metrics" for m in of_kind("ServiceMonitor") for e in m["spec"]["endpoints"])


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
    scraped = scraped_services()
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


# --- secrets ------------------------------------------------------------------------------------------


def test_every_generated_secret_comes_from_an_uncommitted_file_with_a_committed_example():
    source = (KUSTOMIZE_DIR / "kustomization.yaml").read_text()
    kustomization = yaml.safe_load(source)
    ignored = (ROOT / ".gitignore").read_text().split()
    docker_ignored = (ROOT / ".dockerignore").read_text().split()
    names = {generator["name"] for generator in kustomization["secretGenerator"]}
    assert names == {"ardit-handoff", "ardit-api-keys"}
    for generator in kustomization["secretGenerator"]:
        for name in generator["envs"]:
            path = (KUSTOMIZE_DIR / name).relative_to(ROOT).as_posix()
            assert path in ignored and path in docker_ignored, path
            # The kustomization and docs/scale-out.md say how to make it from the example that stands in here.
            copy_example = f"cp {GENERATOR_ENV_STAND_INS[name].relative_to(ROOT).as_posix()} {path}"
            assert copy_example in source and copy_example in (ROOT / "docs" / "scale-out.md").read_text()


def test_the_ar_reads_its_api_keys_from_the_generated_secret_only():
    (ar,) = containers(tier("ar"))
    assert env_of(ar)["ARDIT_AR_API_KEYS"] == {
        "name": "ARDIT_AR_API_KEYS",
        "valueFrom": {"secretKeyRef": {"name": "ardit-api-keys", "key": "ARDIT_AR_API_KEYS"}},
    }
    for deployment in of_kind("Deployment"):
        for container in containers(deployment):
            assert not container.get("envFrom"), object_id(deployment)
            if deployment is not tier("ar"):
                assert "ARDIT_AR_API_KEYS" not in env_of(container), object_id(deployment)
    assert "ARDIT_AR_API_KEYS" not in json.dumps(of_kind("ConfigMap"))


def test_the_api_keys_example_is_a_json_list_of_long_keys(monkeypatch):
    example = GENERATOR_ENV_STAND_INS["api-keys.env"]
    values = env_file(example)
    assert set(values) == {"ARDIT_AR_API_KEYS"}
    keys = json.loads(values["ARDIT_AR_API_KEYS"])
    assert isinstance(keys, list) and keys and all(isinstance(k, str) and len(k) >= 16 for k in keys)
    monkeypatch.setenv("ARDIT_AR_API_KEYS", values["ARDIT_AR_API_KEYS"])
    assert ArSettings().api_keys == keys


# --- who may connect to what (NetworkPolicies) ----------------------------------------------------------


def destination(name: str) -> dict:
    return the("Deployment", "ardit-redis") if name == "redis" else tier(name)


EVERYONE = set(callers())
REACHABILITY = [
    # The public API (key-protected): the gateway, wherever it runs, and anyone else.
    ("ar", PORTS["ar"], EVERYONE),
    # The render endpoint and metrics without a key: the picker; metrics: Prometheus.
    ("ar", AR_INTERNAL_PORT, {"picker", "prometheus"}),
    # Every prompt's token ids.
    ("ar", KV_EVENTS_PORT, {"picker"}),
    # Handoffs and metrics.
    ("dit", PORTS["dit"], {"ar", "prometheus"}),
    ("redis", REDIS_PORT, {"ar"}),
]


@pytest.mark.parametrize("name, port, allowed", REACHABILITY, ids=[f"{name}-{port}" for name, port, _ in REACHABILITY])
def test_network_policies_let_in_exactly_the_callers_each_port_needs(name, port, allowed):
    deployment = destination(name)
    assert port in container_ports(deployment).values()
    assert admitted(deployment, port) == allowed


def test_every_connection_the_configuration_makes_is_allowed():
    """The picker's render, metrics and KV-event ports, the AR's DiT and image store URLs, every scrape."""
    picker, _ = callers()["picker"]
    ar, _ = callers()["ar"]
    prometheus, monitoring = callers()["prometheus"]
    _, render_port = url_target(epp_plugin("token-producer")["parameters"]["vllm"]["url"])
    events = epp_plugin("precise-prefix-cache-producer")["parameters"]["kvEventsConfig"]["podDiscoveryConfig"]
    for port in (render_port, epp_plugin("metrics-data-source")["parameters"]["port"], events["socketPort"]):
        assert admits(tier("ar"), port, picker, NAMESPACE), port
    (container,) = containers(tier("ar"))
    env = resolved_env(container)
    for variable in ("ARDIT_AR_DIT_URL", "ARDIT_AR_IMAGE_STORE_URL"):
        assert admits(*url_target(env[variable]), ar, NAMESPACE), variable
    for service, deployment, port in scraped_endpoints():
        assert admits(deployment, port, prometheus, monitoring), service


def test_network_policies_isolate_each_server_on_ports_it_declares_and_leave_egress_open():
    isolated = set()
    for policy in of_kind("NetworkPolicy"):
        (deployment,) = pods_selected(policy["spec"]["podSelector"])
        isolated.add(deployment["metadata"]["name"])
        # Egress stays unrestricted (the ARs call the DiTs, Redis and DNS).
        assert policy["spec"]["policyTypes"] == ["Ingress"], object_id(policy)
        declared = container_ports(deployment)
        for rule in policy["spec"]["ingress"]:
            assert rule["ports"], object_id(policy)
            for entry in rule["ports"]:
                assert entry["port"] in declared or entry["port"] in declared.values(), (object_id(policy), entry)
            for peer in rule.get("from", []):
                assert "ipBlock" not in peer, object_id(policy)
                assert set(peer.get("namespaceSelector", {}).get("matchLabels", {})) <= {"kubernetes.io/metadata.name"}
    assert isolated == {"ardit-ar", "ardit-dit", "ardit-redis"}


@pytest.mark.parametrize(
    "policy, port, intruder",
    [
        ("ardit-ar", AR_INTERNAL_PORT, "gateway elsewhere"),
        ("ardit-ar", KV_EVENTS_PORT, "other pod here"),
        ("ardit-dit", PORTS["dit"], "picker"),
        ("ardit-redis", REDIS_PORT, "dit"),
    ],
)
def test_a_rule_without_sources_lets_everyone_in(policy, port, intruder):
    def open_up(obj):
        for rule in obj["spec"]["ingress"]:
            rule.pop("from", None)

    deployment = pods_selected(the("NetworkPolicy", policy)["spec"]["podSelector"])[0]
    assert intruder not in admitted(deployment, port)
    assert intruder in admitted(deployment, port, mutated("NetworkPolicy", policy, open_up))


# --- shutdown -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("component, variable", [("ar", "ARDIT_AR_DRAIN_SECONDS"), ("dit", "ARDIT_DIT_DRAIN_SECONDS")])
def test_the_grace_period_covers_the_pre_stop_pause_and_the_whole_drain(component, variable):
    """preStop sleeps while the endpoint removal propagates; then SIGTERM starts the drain; the kubelet kills
    at the end of the grace period, which must leave the drain and the exit room."""
    deployment = tier(component)
    (container,) = containers(deployment)
    drain = float(resolved_env(container)[variable])
    assert drain == 150
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2
    pause = float(command[1])
    assert 0 < pause <= 10
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= pause + drain + DRAIN_MARGIN_SECONDS
    assert grace == 180


# --- the shared image store ---------------------------------------------------------------------------


def quantity_bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}
    parsed = re.fullmatch(r"(\d+)([KMG]i|[kmg]b)", quantity)
    assert parsed is not None, quantity
    number, unit = parsed.groups()
    return int(number) * units[unit]


def test_the_ar_keeps_url_images_in_the_shared_redis(monkeypatch):
    (container,) = containers(tier("ar"))
    env = resolved_env(container)
    url = env["ARDIT_AR_IMAGE_STORE_URL"]
    assert urlsplit(url).scheme == "redis"
    assert url_target(url) == (the("Deployment", "ardit-redis"), REDIS_PORT)
    for name, value in env.items():
        if name.startswith("ARDIT_AR_"):
            monkeypatch.setenv(name, value)
    assert ArSettings().image_store_url == url


def test_the_image_store_keeps_nothing_on_disk_and_fits_its_memory_limit(monkeypatch):
    deployment = the("Deployment", "ardit-redis")
    (container,) = containers(deployment)
    assert container["image"] == "redis:7.0"
    args = container["args"]
    options = dict(zip(args[::2], args[1::2], strict=True))
    assert options == {"--save": "", "--appendonly": "no", "--maxmemory": "256mb", "--maxmemory-policy": "volatile-ttl"}
    assert "volumes" not in deployment["spec"]["template"]["spec"] and "volumeMounts" not in container
    resources = container["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"])
    max_memory = quantity_bytes(options["--maxmemory"])
    assert max_memory < quantity_bytes(resources["requests"]["memory"]) <= quantity_bytes(resources["limits"]["memory"])
    # The AR's own byte bound, not Redis's eviction, decides which image goes first.
    (ar,) = containers(tier("ar"))
    for name, value in resolved_env(ar).items():
        if name.startswith("ARDIT_AR_"):
            monkeypatch.setenv(name, value)
    assert ArSettings().image_store_bytes < max_memory


# --- privileges ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("deployment", of_kind("Deployment"), ids=object_id)
def test_every_container_runs_unprivileged(deployment):
    pod = deployment["spec"]["template"]["spec"]
    for container in containers(deployment):
        context = pod.get("securityContext", {}) | container.get("securityContext", {})
        assert context["runAsNonRoot"] is True and context.get("runAsUser", 1) != 0
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"] and not context["capabilities"].get("add")
        assert not context.get("privileged")
