"""compose.yaml (the local cluster) checked against the `kvmesh` command line, then the same
mesh shape run for real by `kvmesh up`'s launcher.

These run in `make test`, without a container runtime (`make test-compose`, tests/compose, builds
the images and runs the cluster with podman), so the files themselves are checked: each
kvmesh service's command goes through `kvmesh.cli.build_parser()` and its service's config,
every address a service is given names a compose service and the port that service listens
on, and healthchecks, start-up order and the OTLP endpoint are wired. Of the Dockerfile, what
holds without building it: every path it COPYs exists, every RUN step calls a tool the base
image has or an earlier step installed, and its `python -c` steps import names the repository
has (a build would fail on any of these). The live part starts a
loopback mesh with as many prefill and decode instances as compose has, sends a request end
to end, and runs scripts/grpc_health_check.py (what the healthchecks run) against it.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from kvmesh.cli import build_parser
from kvmesh.redis_server import free_port
from kvmesh.runtime import settings
from tests.integration.meshutil import complete, running_mesh

ROOT = Path(__file__).resolve().parents[2]
HEALTH_SCRIPT = ROOT / "scripts" / "grpc_health_check.py"
REDIS_URL = "redis://redis:6379/0"
# compose service -> `kvmesh serve` kind
KVMESH_SERVICES = {
    "gateway": "gateway",
    "prefill-0": "prefill",
    "prefill-1": "prefill",
    "decode-0": "decode",
    "decode-1": "decode",
}
GRPC_NAMES = {"gateway": "kvmesh.v1.Gateway", "prefill": "kvmesh.v1.Prefill", "decode": "kvmesh.v1.Decode"}


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]


def _parse(command: list[str]) -> argparse.Namespace:
    try:
        return build_parser().parse_args(command)
    except SystemExit as exc:  # argparse's way of rejecting a command line
        pytest.fail(f"`kvmesh {' '.join(command)}` does not parse (exit {exc.code})")


def _config(service: dict):
    """The service's frozen config, built as its main() builds it."""
    args = _parse(service["command"])
    return settings.from_args(args.config_cls, args)


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # compose also takes ["KEY=value", ...]
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _listen_ports(services: dict) -> dict[str, int]:
    """compose service -> the port it serves on inside the compose network."""
    ports = {name: _config(services[name]).port for name in KVMESH_SERVICES}
    ports["redis"] = 6379
    return ports


def test_services_are_redis_jaeger_prometheus_grafana_gateway_two_prefill_two_decode(services):
    assert set(services) == {"redis", "jaeger", "prometheus", "grafana", *KVMESH_SERVICES}
    assert services["redis"]["image"].startswith("redis:7")
    assert services["jaeger"]["image"].startswith("jaegertracing/all-in-one")
    assert "16686:16686" in services["jaeger"]["ports"]
    assert "50051:50051" in services["gateway"]["ports"]
    # and its OpenAI-compatible HTTP API, on the port its command serves it on
    assert "8000:8000" in services["gateway"]["ports"] and _config(services["gateway"]).http_port == 8000
    # one image, built from the repository's Dockerfile, for every kvmesh service
    assert {services[n]["build"]["context"] for n in KVMESH_SERVICES} == {"."}
    # on the public Python image unless KVMESH_BASE_IMAGE names another (deploy/compose/local-images.yaml)
    assert {services[n]["build"]["args"]["BASE_IMAGE"] for n in KVMESH_SERVICES} == {
        "${KVMESH_BASE_IMAGE:-python:3.11-slim}"
    }
    assert len({services[n]["image"] for n in KVMESH_SERVICES}) == 1
    assert (ROOT / "Dockerfile").is_file()


@pytest.mark.parametrize("name", sorted(KVMESH_SERVICES))
def test_command_parses_and_builds_its_config(services, name):
    command = services[name]["command"]
    assert isinstance(command, list) and command[:2] == ["serve", KVMESH_SERVICES[name]], command
    config = _config(services[name])
    # reachable from the other containers, on a port stated in the file (not picked at run time)
    assert config.host == "0.0.0.0"
    assert "--port" in command and config.port > 0
    kind = KVMESH_SERVICES[name]
    if kind == "decode":
        assert "--kv-port" in command and config.kv_port > 0
        assert config.kv_port != config.port
        # prefill pushes KV to this name: the decode's own compose service, not 0.0.0.0
        assert config.advertise_host == name
    if kind == "prefill":
        assert config.instance_id == name  # names the instance in the prefix index and in answers
        assert config.redis_url == REDIS_URL
    if kind == "gateway":
        assert config.redis_url == REDIS_URL


def test_every_address_names_a_compose_service_and_its_port(services):
    ports = _listen_ports(services)
    gateway = _config(services["gateway"])
    for kind, addresses in (("prefill", gateway.prefill_addresses), ("decode", gateway.decode_addresses)):
        # every instance of the kind, each once
        assert sorted(_host_port(a)[0] for a in addresses) == sorted(
            n for n, k in KVMESH_SERVICES.items() if k == kind
        ), addresses
        for address in addresses:
            host, port = _host_port(address)
            assert port == ports[host], f"gateway's --{kind} {address}: {host} listens on {ports[host]}"
    for name in ("gateway", "prefill-0", "prefill-1"):
        url = urlparse(_config(services[name]).redis_url)
        assert url.scheme == "redis" and url.hostname in services, (name, url)
        assert url.port == ports[url.hostname], (name, url)


def test_healthchecks_ask_the_grpc_health_service(services):
    ports = _listen_ports(services)
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    for name, kind in KVMESH_SERVICES.items():
        test = services[name]["healthcheck"]["test"]
        # the Dockerfile copies the script to /app/scripts/ beside the installed wheel
        assert test[:3] == ["CMD", "python", "/app/scripts/grpc_health_check.py"], test
        assert test[3] == f"127.0.0.1:{ports[name]}", test
        assert test[4] == GRPC_NAMES[kind], test
    assert HEALTH_SCRIPT.is_file()


def test_start_order_waits_for_healthy_dependencies(services):
    def healthy(name: str) -> set[str]:
        depends = services[name].get("depends_on") or {}
        return {d for d, spec in depends.items() if spec.get("condition") == "service_healthy"}

    assert healthy("gateway") >= {"redis", "prefill-0", "prefill-1", "decode-0", "decode-1"}
    assert healthy("prefill-0") >= {"redis"} and healthy("prefill-1") >= {"redis"}
    for name in KVMESH_SERVICES:
        for dependency in healthy(name):  # a condition nobody could meet would block start-up
            assert "healthcheck" in services[dependency], (name, dependency)


def test_spans_go_to_jaegers_otlp_grpc_port(services):
    assert _env(services["jaeger"])["COLLECTOR_OTLP_ENABLED"] == "true"
    for name in KVMESH_SERVICES:
        env = _env(services[name])
        endpoint = urlparse(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert (endpoint.hostname, endpoint.port) == ("jaeger", 4317), (name, endpoint)
        assert env["OTEL_SERVICE_NAME"] == f"kvmesh-{name}"


def test_dockerfile_text_names_the_base_image_user_entrypoint_and_model_conversion():
    # the Dockerfile's text only (no Docker here); the tests below check what it refers to
    text = (ROOT / "Dockerfile").read_text()
    assert text.startswith("#") and "ARG BASE_IMAGE=python:3.11-slim" in text
    assert text.count("FROM ${BASE_IMAGE}") == 2  # both stages on the one base (a build argument)
    assert 'ENTRYPOINT ["kvmesh"]' in text
    assert "USER kvmesh" in text and "KVMESH_CACHE_DIR=" in text
    assert "RUN kvmesh warm" in text  # the GGUF is converted and the kernels compiled at build time
    # kvmesh comes from its wheel, built in a first stage, not from the source tree
    assert "python -m build --wheel" in text and "pip install /tmp/dist/kvmesh-*.whl" in text
    assert "pip install ." not in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git"} <= set(ignored) and "scripts" not in ignored


# What a Debian base has on its PATH among the tools our RUN steps may use (python and pip: from
# the venv deploy/image/python.sh makes, which the Dockerfile's ENV puts on PATH; the
# tests/compose suite builds the image for real)
BASE_IMAGE_TOOLS = {"sh", "apt-get", "rm", "useradd", "mkdir", "chown", "python", "pip"}
SHELL_SEPARATORS = {"&&", "||", ";", "|"}


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each Dockerfile instruction: comments dropped, lines ending
    in a backslash joined with the next (as Docker joins them)."""
    steps, pending = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") or not (pending or line.strip()):
            continue
        pending += line
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        keyword, _, args = pending.strip().partition(" ")
        steps.append((keyword.upper(), args.strip()))
        pending = ""
    assert not pending, f"Dockerfile ends inside a continued line: {pending!r}"
    return steps


def _shell_commands(run_args: str) -> list[list[str]]:
    """The simple commands of a RUN line (split at &&, ||, ; and |), each as its words."""
    lexer = shlex.shlex(run_args, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for word in lexer:
        if word in SHELL_SEPARATORS:
            commands.append([])
        else:
            commands[-1].append(word)
    return [c for c in commands if c]


def test_dockerfile_copies_only_paths_that_exist():
    copies = [args.split() for keyword, args in _dockerfile() if keyword == "COPY"]
    assert copies, "the Dockerfile copies nothing"
    for words in copies:
        if any(w.startswith("--from=") for w in words):
            continue  # from an earlier stage, not from the repository
        sources = [w for w in words[:-1] if not w.startswith("--")]  # the last word is the destination
        assert sources, words
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"


def test_dockerfile_run_steps_use_tools_the_image_has():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "kvmesh" in scripts
    available = set(BASE_IMAGE_TOOLS)
    for keyword, args in _dockerfile():
        if keyword == "RUN":
            for command in _shell_commands(args):
                assert command[0] in available, f"RUN calls {command[0]!r}: not in the base image, not installed before"
                if command[:2] == ["apt-get", "install"]:
                    available |= {w for w in command[2:] if not w.startswith("-")}
                if command[:2] == ["pip", "install"] and any(w.endswith(".whl") for w in command[2:]):
                    available |= set(scripts)  # the project's console scripts, from its wheel
        if keyword == "ENTRYPOINT":
            entrypoint = json.loads(args)[0]
            assert entrypoint in available, f"ENTRYPOINT {entrypoint!r} is not installed by an earlier step"


def _python_steps() -> list[str]:
    """The code of every `python -c CODE` in the Dockerfile's RUN steps."""
    return [
        command[command.index("-c") + 1]
        for keyword, args in _dockerfile()
        if keyword == "RUN"
        for command in _shell_commands(args)
        if command[0] == "python" and "-c" in command
    ]


def test_dockerfile_python_steps_import_what_the_repo_has():
    codes = _python_steps()
    assert len(codes) >= 1, codes  # the requirements list
    for code in codes:
        tree = ast.parse(code)
        imported = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    imported[alias.asname or alias.name] = importlib.import_module(alias.name)
            elif isinstance(node, ast.ImportFrom):
                assert node.module, code
                try:
                    module = importlib.import_module(node.module)
                except ModuleNotFoundError as exc:
                    pytest.fail(f"a RUN step imports from {node.module}, which does not exist: {exc}")
                for alias in node.names:
                    assert hasattr(module, alias.name), f"a RUN step imports {alias.name} from {node.module}: not there"
                    imported[alias.asname or alias.name] = getattr(module, alias.name)
        # a method called on an instance of an imported class (`ModelRunner(...).warmup()`) exists too
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name)
                and isinstance(imported.get(node.value.func.id), type)
            ):
                cls = imported[node.value.func.id]
                assert hasattr(cls, node.attr), f"a RUN step calls {cls.__name__}(...).{node.attr}: no such method"


# -- live: the same shape on loopback ------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh(services, fault_mesh):
    """test_faults' 2 + 2 mesh (tests/conftest.py), shared: these tests only ask it and leave it
    idle. One of its own when test_faults ran first and killed that one's instances."""
    gateway = _config(services["gateway"])
    shape = (len(gateway.prefill_addresses), len(gateway.decode_addresses))
    if (len(fault_mesh.prefill_addresses), len(fault_mesh.decode_addresses)) == shape and all(
        p.poll() is None for p in [*(p for _, p in fault_mesh.procs), *fault_mesh.extra_procs]
    ):
        yield fault_mesh
        return
    with running_mesh(*shape) as m:
        assert (len(m.prefill_addresses), len(m.decode_addresses)) == (2, 2)
        yield m


def test_mesh_of_the_same_shape_answers_end_to_end(mesh):
    c = complete(mesh, "What is the capital of France?", chat=True, max_tokens=8)
    assert c.text.strip(), c
    assert c.final is not None and c.final.generated_tokens > 0, c.final
    assert c.final.prefill_instance and c.final.decode_instance, c.final


def _health_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HEALTH_SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_health_check_script_exits_0_only_when_serving(mesh):
    assert _health_check(mesh.gateway_address).returncode == 0
    ok = _health_check(mesh.gateway_address, "kvmesh.v1.Gateway")
    assert ok.returncode == 0, ok.stderr
    for address in [*mesh.prefill_addresses, *mesh.decode_addresses]:
        assert _health_check(address).returncode == 0, address
    # a service this server does not have: NOT_FOUND
    unknown = _health_check(mesh.gateway_address, "kvmesh.v1.NoSuchService")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr, unknown.stderr
    # nobody listening
    closed = _health_check(f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert closed.returncode != 0 and "UNAVAILABLE" in closed.stderr, closed.stderr


def _mounts(service: dict) -> dict[str, Path]:
    """Where each of the service's bind mounts lands in the container -> the file in the repo."""
    out = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        assert source.startswith("./"), volume
        out[target] = ROOT / source
    return out


def test_prometheus_scrapes_every_kvmesh_service_with_the_rules_promtool_accepts(services):
    prometheus = services["prometheus"]
    mounts = _mounts(prometheus)
    config_arg = next(a for a in prometheus["command"] if a.startswith("--config.file="))
    config_file = mounts[config_arg.split("=", 1)[1]]
    config = yaml.safe_load(config_file.read_text())
    (job,) = config["scrape_configs"]
    targets = {t for group in job["static_configs"] for t in group["targets"]}
    assert targets == {f"{name}:{_config(services[name]).metrics_port}" for name in KVMESH_SERVICES}
    # the rules file sits beside the config in the container, as in deploy/prometheus/
    (rules,) = config["rule_files"]
    in_container = str(Path(config_arg.split("=", 1)[1]).parent / rules)
    assert mounts[in_container] == ROOT / "deploy" / "prometheus" / "rules.yml"
    checked = subprocess.run(["promtool", "check", "config", str(config_file)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_grafana_provisions_the_dashboard_over_the_compose_prometheus(services):
    grafana = services["grafana"]
    mounts = _mounts(grafana)
    provisioning = mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    url = urlparse(source["url"])
    assert source["type"] == "prometheus" and source["isDefault"]
    assert url.hostname == "prometheus" and f"{url.port}:{url.port}" in services["prometheus"]["ports"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "kvmesh.yml").read_text())["providers"]
    dashboards = [t for t in mounts if t.startswith(provider["options"]["path"] + "/")]
    assert [mounts[t] for t in dashboards] == [ROOT / "deploy" / "grafana" / "kvmesh.json"]
    # the dashboard picks its data source by type, so the provisioned one is used
    panels = json.loads((ROOT / "deploy" / "grafana" / "kvmesh.json").read_text())
    (variable,) = panels["templating"]["list"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
