"""deploy/kubernetes: every overlay renders, every object is valid against the Kubernetes
schemas (offline, kubernetes-validate), and the objects agree with each other and with kvserve
(selectors, ports, probe paths, grace periods, the gateway's discovery flags). No cluster is
reachable from here: this is what can be checked without one."""

from __future__ import annotations

import re
import subprocess

import pytest

from kvserve.engine.kv_memory import CPU_RUNTIME_OVERHEAD_BYTES
from kvserve.server.app import build_app
from kvserve.server.metrics import ServerMetrics
from kvserve.server.settings import ServerSettings
from tests.deploy.kustomize_render import (
    OVERLAYS, REPO, Manifest, container, env_value, find, kubectl, port_number, render, selects,
)
from tests.deploy.test_dockerfile import hadolint_binary

pytestmark = pytest.mark.skipif(kubectl() is None, reason="kubectl is not installed (needed for `kubectl kustomize`)")

# The oldest Kubernetes release still commonly run, and the newest schemas this package knows.
SCHEMA_VERSIONS = ("1.30.0", "latest")
PRESTOP_ALLOWANCE_S = 5


# ids are not bare "cpu"/"gpu": a test whose keywords include "gpu" is skipped without CUDA.
@pytest.fixture(scope="module", params=OVERLAYS, ids=[f"{overlay}-overlay" for overlay in OVERLAYS])
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[Manifest]]:
    return request.param, render(request.param)


def _kvserve_paths() -> set[str]:
    """The paths kvserve answers GET on (probes and scrapes are GETs)."""
    app = build_app(None, ServerSettings(), metrics=ServerMetrics("m", {}))
    return {path for path, methods in app.openapi()["paths"].items() if "get" in methods}


def test_every_object_is_valid_against_the_kubernetes_schemas(rendered: tuple[str, list[Manifest]]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    _, objects = rendered
    assert {o["kind"] for o in objects} >= {"Deployment", "Service", "PodDisruptionBudget", "ServiceAccount",
                                             "Role", "RoleBinding"}
    for version in SCHEMA_VERSIONS:
        desired = kubernetes_validate.latest_version() if version == "latest" else version
        for obj in objects:
            # strict: unknown fields (typos) fail too
            kubernetes_validate.validate(obj, desired, strict=True)


def test_selectors_select_the_pods_they_mean(rendered: tuple[str, list[Manifest]]) -> None:
    _, objects = rendered
    for deployment in (o for o in objects if o["kind"] == "Deployment"):
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selects(deployment["spec"]["selector"]["matchLabels"], pod_labels), deployment["metadata"]["name"]
    kvserve = find(objects, "Deployment", "kvserve")
    kvserve_labels = kvserve["spec"]["template"]["metadata"]["labels"]
    gateway = find(objects, "Deployment", "sglang-gateway")
    gateway_labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert selects(find(objects, "PodDisruptionBudget", "kvserve")["spec"]["selector"]["matchLabels"], kvserve_labels)
    assert selects(find(objects, "Service", "kvserve")["spec"]["selector"], kvserve_labels)
    assert selects(find(objects, "Service", "sglang-gateway")["spec"]["selector"], gateway_labels)
    # Each Service selects only its own pods.
    assert not selects(find(objects, "Service", "kvserve")["spec"]["selector"], gateway_labels)
    assert not selects(find(objects, "Service", "sglang-gateway")["spec"]["selector"], kvserve_labels)


def test_ports_and_probes_point_at_what_kvserve_serves(rendered: tuple[str, list[Manifest]]) -> None:
    _, objects = rendered
    kvserve = find(objects, "Deployment", "kvserve")
    server = container(kvserve, "kvserve")
    listening = int(env_value(server, "KVSERVE_PORT")["value"])
    assert [p["containerPort"] for p in server["ports"]] == [listening]
    assert env_value(server, "KVSERVE_HOST")["value"] == "0.0.0.0"  # reachable from the pod network
    paths = _kvserve_paths()
    for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = server[probe_name]["httpGet"]
        assert probe["path"] in paths, (probe_name, probe["path"])
        assert port_number(server, probe["port"]) == listening
    # Enough start-up time for a model load (+ compile) on CPU: the image's HEALTHCHECK allows 180 s.
    startup = server["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 180
    for service_port in find(objects, "Service", "kvserve")["spec"]["ports"]:
        assert port_number(server, service_port["targetPort"]) == listening
    annotations = kvserve["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == listening
    assert annotations["prometheus.io/path"] in paths


def test_termination_leaves_time_for_the_drain(rendered: tuple[str, list[Manifest]]) -> None:
    _, objects = rendered
    kvserve = find(objects, "Deployment", "kvserve")
    server = container(kvserve, "kvserve")
    grace = float(env_value(server, "KVSERVE_SHUTDOWN_GRACE_PERIOD")["value"])
    assert server["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(PRESTOP_ALLOWANCE_S)]
    assert kvserve["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= PRESTOP_ALLOWANCE_S + grace
    # A rolling update never takes a replica away before its successor is ready.
    assert kvserve["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_resources_and_kv_cache_memory(rendered: tuple[str, list[Manifest]]) -> None:
    overlay, objects = rendered
    server = container(find(objects, "Deployment", "kvserve"), "kvserve")
    resources = server["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"]  # no overcommit: OOM is fatal
    # kvserve sizes its KV cache from the cgroup memory limit and its threads from the CPU limit,
    # so the manifests set limits and leave both settings to it (and run the image's entrypoint).
    env = {entry["name"] for entry in server.get("env", [])}
    assert not env & {"KVSERVE_KV_CACHE_MEMORY", "KVSERVE_NUM_KV_BLOCKS", "OMP_NUM_THREADS", "KVSERVE_CPU_THREADS"}
    assert "command" not in server and "args" not in server
    if overlay == "gpu":
        assert resources["limits"]["nvidia.com/gpu"] == "1"
        assert env_value(server, "KVSERVE_DEVICE")["value"] == "cuda"
        return
    # Room for the weights, the runtime overhead kvserve reserves, and a KV cache.
    assert _gibibytes(resources["limits"]["memory"]) >= 2 + CPU_RUNTIME_OVERHEAD_BYTES / 2**30
    assert resources["limits"]["cpu"] == resources["requests"]["cpu"]


def _gibibytes(quantity: str) -> float:
    units = {"Gi": 1.0, "Mi": 1 / 1024}
    for suffix, scale in units.items():
        if quantity.endswith(suffix):
            return float(quantity.removesuffix(suffix)) * scale
    raise AssertionError(f"memory quantity {quantity!r}: use Gi or Mi")


def test_gateway_discovers_the_kvserve_pods(rendered: tuple[str, list[Manifest]]) -> None:
    router_args = pytest.importorskip("sglang_router.launch_router")
    _, objects = rendered
    kvserve = find(objects, "Deployment", "kvserve")
    server = container(kvserve, "kvserve")
    gateway = find(objects, "Deployment", "sglang-gateway")
    gateway_container = container(gateway, "gateway")
    args = [a.replace("$(POD_NAMESPACE)", "kvserve") for a in gateway_container["args"]]
    assert env_value(gateway_container, "POD_NAMESPACE")["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    parsed = router_args.parse_router_args(args)  # the gateway's own parser: every flag exists
    assert parsed.service_discovery and not parsed.worker_urls
    assert selects(parsed.selector, kvserve["spec"]["template"]["metadata"]["labels"])
    assert parsed.service_discovery_port == server["ports"][0]["containerPort"]
    assert parsed.service_discovery_namespace == "kvserve"
    assert parsed.health_check_endpoint in _kvserve_paths()
    named_ports = {p["name"]: p["containerPort"] for p in gateway_container["ports"]}
    assert named_ports["http"] == parsed.port and named_ports["metrics"] == parsed.prometheus_port
    annotations = gateway["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == parsed.prometheus_port
    for service_port in find(objects, "Service", "sglang-gateway")["spec"]["ports"]:
        assert port_number(gateway_container, service_port["targetPort"]) == parsed.port


def test_gateway_may_watch_pods_and_nothing_more(rendered: tuple[str, list[Manifest]]) -> None:
    _, objects = rendered
    pod_spec = find(objects, "Deployment", "sglang-gateway")["spec"]["template"]["spec"]
    account = find(objects, "ServiceAccount", pod_spec["serviceAccountName"])
    binding = find(objects, "RoleBinding", "sglang-gateway")
    assert {"kind": "ServiceAccount", "name": account["metadata"]["name"]} in binding["subjects"]
    role = find(objects, binding["roleRef"]["kind"], binding["roleRef"]["name"])
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    # kvserve itself needs no API access.
    assert "serviceAccountName" not in find(objects, "Deployment", "kvserve")["spec"]["template"]["spec"]


def test_gateway_image_is_built_from_the_version_the_overlays_run(rendered: tuple[str, list[Manifest]]) -> None:
    _, objects = rendered
    dockerfile = (REPO / "deploy" / "router" / "gateway.Dockerfile").read_text()
    version = re.search(r"^ARG SGLANG_ROUTER_VERSION=(\S+)$", dockerfile, re.M)
    assert version is not None
    gateway = container(find(objects, "Deployment", "sglang-gateway"), "gateway")
    assert gateway["image"] == f"sglang-gateway:{version[1]}"
    hadolint = hadolint_binary()
    if hadolint is not None:
        result = subprocess.run([hadolint, "--no-color", "--failure-threshold", "info", "-"], input=dockerfile,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr
