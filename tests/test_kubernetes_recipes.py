"""deploy/kubernetes: every document validated offline, and the references between them.

Built-in kinds are checked against Kubernetes' own schemas (kubernetes-validate, strict:
unknown fields fail); InferencePool, Gateway and HTTPRoute against their CRDs' published
openAPIV3Schema, pinned in deploy/kubernetes/schemas (unknown fields fail there too, as
with kubectl's strict field validation; CEL rules are not evaluated). The commands the
containers run are parsed by the parsers of the programs that will read them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "deploy" / "kubernetes"
SCHEMAS = RECIPES / "schemas"
# A release that managed clusters run; the recipes use nothing newer (sleep preStop: 1.30+).
KUBERNETES_VERSION = "1.34.0"
BUILT_IN = {"v1", "apps/v1", "rbac.authorization.k8s.io/v1"}
# (apiVersion, kind) of the CRD kinds used, each pinned as schemas/<kind>-<group>-<version>.json
CRDS = {
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    ("gateway.networking.k8s.io/v1", "Gateway"),
}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# preStop sleep + --drain-timeout + this must fit the grace period: listener stop (0.5 s)
# and the device process's shutdown.
SHUTDOWN_MARGIN_S = 10


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(RECIPES.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


DOCS = _documents()


def _id(item: tuple[str, dict[str, Any]]) -> str:
    name, doc = item
    return f"{name}:{doc['kind']}/{doc['metadata']['name']}"


def _find(kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for _, d in DOCS if d["kind"] == kind and name in (None, d["metadata"]["name"])]


def _one(kind: str, name: str) -> dict[str, Any]:
    found = _find(kind, name)
    assert len(found) == 1, f"expected one {kind} {name!r}, found {len(found)}"
    return found[0]


def _strict(schema: Any) -> Any:
    """The schema with unknown fields refused wherever the CRD lists an object's fields."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _crd_validator(api_version: str, kind: str) -> jsonschema.Validator:
    group, version = api_version.split("/")
    schema = json.loads((SCHEMAS / f"{kind.lower()}-{group}-{version}.json").read_text())
    # OpenAPI 3.0 schemas follow draft 4 (boolean exclusiveMinimum and the like).
    return jsonschema.Draft4Validator(_strict(schema))


def test_the_recipes_are_all_there():
    kinds = {(name, d["kind"]) for name, d in DOCS}
    assert ("engine.yaml", "Deployment") in kinds
    assert ("inference-gateway.yaml", "InferencePool") in kinds
    assert ("vllm-router.yaml", "Deployment") in kinds
    assert ("kv-aware.yaml", "StatefulSet") in kinds


@pytest.mark.parametrize("item", DOCS, ids=_id)
def test_every_document_validates_against_its_schema(item):
    _, doc = item
    assert DNS_LABEL.match(doc["metadata"]["name"]), doc["metadata"]["name"]
    key = (doc["apiVersion"], doc["kind"])
    if doc["apiVersion"] in BUILT_IN:
        kubernetes_validate = pytest.importorskip("kubernetes_validate")
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    else:
        assert key in CRDS, f"no pinned schema for {key}"
        errors = sorted(_crd_validator(*key).iter_errors(doc), key=str)
        assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_a_misspelt_field_fails_both_kinds_of_schema():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    pool = json.loads(json.dumps(_one("InferencePool", "async-engine")))
    pool["spec"]["targetPort"] = pool["spec"].pop("targetPorts")
    assert not _crd_validator(pool["apiVersion"], pool["kind"]).is_valid(pool)
    deployment = json.loads(json.dumps(_one("Deployment", "async-engine")))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


# ------------------------------------------------------------------ cross-references
WORKLOADS = _find("Deployment") + _find("StatefulSet")


def _pods() -> list[dict[str, Any]]:
    return [d["spec"]["template"] for d in WORKLOADS]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _container_ports(pod: dict[str, Any]) -> set[Any]:
    ports: set[Any] = set()
    for c in pod["spec"]["containers"]:
        for p in c.get("ports", []):
            ports |= {p["containerPort"], p.get("name")}
    return ports - {None}


@pytest.mark.parametrize("deployment", WORKLOADS, ids=lambda d: d["metadata"]["name"])
def test_workloads_select_their_own_pods_and_probe_their_own_ports(deployment):
    pod = deployment["spec"]["template"]
    assert _selects(deployment["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    ports = _container_ports(pod)
    for c in pod["spec"]["containers"]:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in c:
                action = c[probe].get("httpGet") or c[probe].get("grpc")
                assert action["port"] in ports, f"{probe} port {action['port']} not in {ports}"
    if "serviceAccountName" in pod["spec"]:
        _one("ServiceAccount", pod["spec"]["serviceAccountName"])


@pytest.mark.parametrize("service", _find("Service"), ids=lambda d: d["metadata"]["name"])
def test_services_select_pods_and_target_their_ports(service):
    pods = [p for p in _pods() if _selects(service["spec"]["selector"], p["metadata"]["labels"])]
    assert pods, f"Service {service['metadata']['name']} selects no pod"
    for port in service["spec"]["ports"]:
        for pod in pods:
            assert port.get("targetPort", port["port"]) in _container_ports(pod)


def test_role_bindings_name_existing_roles_and_accounts():
    for binding in _find("RoleBinding"):
        _one("Role", binding["roleRef"]["name"])
        for subject in binding["subjects"]:
            _one("ServiceAccount", subject["name"])


ENGINES = [("Deployment", "async-engine"), ("StatefulSet", "async-engine-kv")]


def _engine(kind: str = "Deployment", name: str = "async-engine") -> tuple[dict, dict]:
    workload = _one(kind, name)
    return workload, workload["spec"]["template"]["spec"]["containers"][0]


def _port(container: dict[str, Any], name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e[1])
def test_the_engine_command_parses_with_our_cli_and_matches_its_ports(engine):
    from async_engine.cli.main import build_parser

    deployment, container = _engine(*engine)
    assert container["command"] == ["async-engine"]
    args = build_parser().parse_args(container["args"])
    assert args.command == "serve"
    assert args.host == "0.0.0.0"  # the probes and other pods reach it from outside
    assert args.http_port == _port(container, "http")
    assert args.port == _port(container, "grpc")
    assert args.metrics_port == _port(container, "metrics")


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e[1])
def test_the_grace_period_covers_the_pre_stop_sleep_and_the_drain(engine):
    from async_engine.cli.main import build_parser

    deployment, container = _engine(*engine)
    args = build_parser().parse_args(container["args"])
    sleep_s = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace_s = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert sleep_s + args.drain_timeout + SHUTDOWN_MARGIN_S <= grace_s
    # Liveness must not kill a draining replica: its failures take longer than the drain.
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > args.drain_timeout
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"


def test_the_inference_pool_selects_the_engine_pods_and_its_picker():
    pool = _one("InferencePool", "async-engine")
    _, container = _engine()
    engine_pod = _one("Deployment", "async-engine")["spec"]["template"]
    assert _selects(pool["spec"]["selector"]["matchLabels"], engine_pod["metadata"]["labels"])
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [_port(container, "http")]
    ref = pool["spec"]["endpointPickerRef"]
    service = _one("Service", ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]


def test_the_picker_watches_this_pool_with_the_config_it_mounts():
    pool = _one("InferencePool", "async-engine")
    pod = _one("Deployment", "async-engine-epp")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
    assert args[args.index("--pool-group") + 1] == pool["apiVersion"].split("/")[0]
    config = Path(args[args.index("--config-file") + 1])
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(config.parent))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config_map = _one("ConfigMap", volume["configMap"]["name"])
    plugins = yaml.safe_load(config_map["data"][config.name])
    assert plugins["kind"] == "EndpointPickerConfig"
    refs = {p["pluginRef"] for prof in plugins["schedulingProfiles"] for p in prof["plugins"]}
    assert refs <= {p["type"] for p in plugins["plugins"]}
    role = _one("Role", pod["serviceAccountName"])
    rules = role["rules"]
    granted = {(g, r) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= granted


def test_the_route_sends_to_the_pool_through_the_gateway():
    route = _one("HTTPRoute", "async-engine")
    for parent in route["spec"]["parentRefs"]:
        gateway = _one("Gateway", parent["name"])
        listeners = [entry["name"] for entry in gateway["spec"]["listeners"]]
        assert parent.get("sectionName", listeners[0]) in listeners
    for rule in route["spec"]["rules"]:
        for backend in rule["backendRefs"]:
            assert (backend["group"], backend["kind"]) == (
                "inference.networking.k8s.io",
                "InferencePool",
            )
            _one("InferencePool", backend["name"])


def test_the_router_command_parses_with_vllm_router_and_finds_the_engine_pods():
    launch = pytest.importorskip("vllm_router.launch_router")
    pod = _one("Deployment", "vllm-router")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["vllm-router"]
    # Kubernetes expands $(POD_NAMESPACE) from the container's env before the router runs.
    assert "POD_NAMESPACE" in {e["name"] for e in container["env"]}
    args = launch.parse_router_args(
        [a.replace("$(POD_NAMESPACE)", "default") for a in container["args"]]
    )
    _, engine = _engine()
    engine_labels = _one("Deployment", "async-engine")["spec"]["template"]["metadata"]["labels"]
    assert args.service_discovery
    assert _selects(args.selector, engine_labels)
    assert args.service_discovery_port == _port(engine, "http")
    assert args.health_check_endpoint == "/health"
    assert args.port == _port(container, "http")
    assert args.prometheus_port == _port(container, "metrics")
    assert args.policy in ("power_of_two", "cache_aware", "round_robin", "random")


# ------------------------------------------------------------------ kv_aware recipe
def _kv_engine_args() -> tuple[dict[str, Any], dict[str, Any], Any]:
    from async_engine.cli.main import build_parser

    stateful, container = _engine("StatefulSet", "async-engine-kv")
    return stateful, container, build_parser().parse_args(container["args"])


def test_the_kv_aware_engines_publish_kv_events_on_their_kv_port():
    from async_engine.kv_events.publisher import binds

    _, container, args = _kv_engine_args()
    scheme, _, port = args.kv_events_endpoint.rpartition(":")
    assert binds(args.kv_events_endpoint) and scheme == "tcp://*"  # every interface
    assert int(port) == _port(container, "kv-events")


def test_the_kv_aware_pods_have_stable_names_through_a_headless_service():
    stateful, _, _ = _kv_engine_args()
    service = _one("Service", stateful["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert _selects(service["spec"]["selector"], stateful["spec"]["template"]["metadata"]["labels"])
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"http", "kv-events"}


def test_the_kv_aware_router_names_every_engine_pod_and_its_event_stream():
    launch = pytest.importorskip("vllm_router.launch_router")
    stateful, engine, engine_args = _kv_engine_args()
    container = _one("Deployment", "vllm-router-kv")["spec"]["template"]["spec"]["containers"][0]
    args = launch.parse_router_args(container["args"])
    name, service = stateful["metadata"]["name"], stateful["spec"]["serviceName"]
    hosts = [f"{name}-{k}.{service}" for k in range(stateful["spec"]["replicas"])]
    urls = [f"http://{host}:{_port(engine, 'http')}" for host in hosts]
    assert args.policy == "kv_aware"
    assert args.worker_urls == urls
    assert args.kv_event_source == [
        f"{url}=tcp://{host}:{_port(engine, 'kv-events')}"
        for url, host in zip(urls, hosts, strict=True)
    ]
    assert args.kv_event_block_size == engine_args.block_size
    assert args.kv_event_model == engine_args.model  # the model name requests and events carry
    assert args.kv_aware_session_affinity_ttl_secs and args.kv_aware_session_affinity_ttl_secs > 0
    assert args.health_check_endpoint == "/health"
    assert args.port == _port(container, "http")
    assert args.prometheus_port == _port(container, "metrics")
