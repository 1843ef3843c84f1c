"""The Kubernetes manifests run what compose.yaml runs: the same images, the same commands and flags
for each role (compose's ${VAR:-default} is $(VAR) here, and the ConfigMap holds the same
default), the same environment, ports and health checks. The differences are the ones the
manifests are for, listed here (DIFFERENCES) and nowhere else."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.unit.deploy.conftest import (
    ROOT,
    as_kubernetes,
    by_kind,
    compose_defaults,
    container,
    pod_spec,
)

Objs = list[dict[str, Any]]

# compose's service names -> the Kubernetes Services'
HOSTS = {"prefill": "pdserve-prefill", "decode": "pdserve-decode", "kvstore": "pdserve-kvstore",
         "router": "pdserve-router", "redis": "pdserve-redis"}
# compose service -> (Deployment, container)
ROLES = {"router": ("pdserve-router", "router"), "prefill": ("pdserve-prefill", "worker"),
         "decode": ("pdserve-decode", "worker"), "kvstore": ("pdserve-kvstore", "kvstore"),
         "autoscaler": ("pdserve-autoscaler", "autoscaler")}
REDIS_NODES = ",".join(f"pdserve-redis-{i}.pdserve-redis:6379" for i in range(3))
# What Kubernetes runs differently, by compose service: flag -> its value here (None: dropped).
DIFFERENCES: dict[str, dict[str, str | None]] = {
    # the store's data on the Redis Cluster, through stateless front-ends (issue 21), scraped
    "kvstore": {"--backend": "redis-cluster", "--redis-url": f"redis://{REDIS_NODES}"},
    # workers spread over every front-end of the headless Service
    "prefill": {"--kv-store-url": "dns:pdserve-kvstore:50071"},
    "decode": {"--kv-store-url": "dns:pdserve-kvstore:50071"},
    # the Kubernetes actuator instead of the Docker one
    "autoscaler": {"--project": None, "--actuator": "kubernetes",
                   "--prefill-deployment": "pdserve-prefill", "--decode-deployment": "pdserve-decode",
                   "--prefill-port": "50051", "--decode-port": "50061"},
}
# compose variables that are not settings of the ConfigMap
NOT_SETTINGS = {"COMPOSE_PROJECT_NAME", "PDSERVE_PORT", "PDSERVE_API_KEY", "PDSERVE_ADMIN_API_KEY"}


def flags(argv: list[str]) -> tuple[list[str], dict[str, str | bool]]:
    """(the words before the first flag, each --flag's value or True)."""
    first = next((i for i, a in enumerate(argv) if a.startswith("--")), len(argv))
    out: dict[str, str | bool] = {}
    i = first
    while i < len(argv):
        assert argv[i].startswith("--"), argv[i]
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[argv[i]], i = argv[i + 1], i + 2
        else:
            out[argv[i]], i = True, i + 1
    return argv[:first], out


def compose_argv(service: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(entrypoint, command) of a compose service, as the manifests would write them."""
    return ([as_kubernetes(a, HOSTS) for a in service.get("entrypoint", [])],
            [as_kubernetes(a, HOSTS) for a in service.get("command", [])])


@pytest.fixture(scope="module")
def settings(cpu: Objs) -> dict[str, str]:
    data: dict[str, str] = by_kind(cpu, "ConfigMap")["pdserve-config"]["data"]
    return data


@pytest.mark.parametrize("name", sorted(ROLES))
def test_each_role_runs_composes_command(compose: dict[str, Any], cpu: Objs, name: str) -> None:
    entrypoint, command = compose_argv(compose["services"][name])
    deployment, cname = ROLES[name]
    c = container(by_kind(cpu, "Deployment")[deployment], cname)
    # compose's entrypoint is Kubernetes' command, compose's command its args (the image has no
    # ENTRYPOINT: without one, compose's command is the whole command line, Kubernetes' args).
    if entrypoint:
        assert c["args"] == command and len(c["command"]) == len(entrypoint)
    else:
        assert "command" not in c
    head, want = flags(entrypoint + command)
    for flag, value in DIFFERENCES.get(name, {}).items():
        assert flag not in want or value is None or want[flag] != value, f"{flag}: no longer differs"
        if value is None:
            del want[flag]
        else:
            want[flag] = value
    got_head, got = flags(c.get("command", []) + c.get("args", []))
    assert got_head == head
    assert got == want


def test_the_model_is_prepared_as_composes_model_service(compose: dict[str, Any], cpu: Objs) -> None:
    _, command = compose_argv(compose["services"]["model"])
    for name in ("pdserve-router", "pdserve-prefill", "pdserve-decode"):
        init = container(by_kind(cpu, "Deployment")[name], "model")
        assert init["command"] == command and "args" not in init
        assert {"name": "cache", "mountPath": "/cache"} in init["volumeMounts"]


def test_the_configmap_holds_composes_defaults(compose: dict[str, Any], settings: dict[str, str]) -> None:
    want: dict[str, str] = {}
    for name in (*ROLES, "model"):
        service = compose["services"][name]
        for value in [*service.get("entrypoint", []), *service.get("command", []),
                      *[str(v) for v in service.get("environment", {}).values()]]:
            want |= compose_defaults(value)
    for var in NOT_SETTINGS:
        want.pop(var, None)
    assert {k: settings.get(k) for k in want} == want
    # compose's literal settings of every pdserve container
    assert settings["PDSERVE_CACHE_DIR"] == compose["x-pdserve"]["environment"]["PDSERVE_CACHE_DIR"]
    # nothing in the ConfigMap that compose does not know
    compose_text = (ROOT / "compose.yaml").read_text()
    assert {k for k in settings if k not in compose_text} == set()


def test_replicas_as_composes(cpu: Objs, settings: dict[str, str]) -> None:
    deployments = by_kind(cpu, "Deployment")
    assert deployments["pdserve-prefill"]["spec"]["replicas"] == int(settings["PDSERVE_PREFILL_REPLICAS"])
    assert deployments["pdserve-decode"]["spec"]["replicas"] == int(settings["PDSERVE_DECODE_REPLICAS"])


@pytest.mark.parametrize("name", sorted(ROLES))
def test_each_role_gets_composes_environment(compose: dict[str, Any], cpu: Objs,
                                             settings: dict[str, str], name: str) -> None:
    deployment, cname = ROLES[name]
    c = container(by_kind(cpu, "Deployment")[deployment], cname)
    env = {e["name"]: e for e in c.get("env", [])}
    assert [s["configMapRef"]["name"] for s in c["envFrom"]] == ["pdserve-config"]
    for var, value in compose["services"][name]["environment"].items():
        if var in env:  # the same value, or the same file's name, or the same setting
            got = env[var].get("value")
            if var.endswith("_FILE"):
                assert Path(got).name == Path(value).name, var
            elif got is not None:
                assert got == as_kubernetes(str(value), HOSTS), var
            else:  # from a Secret, as compose's from the environment
                assert env[var]["valueFrom"]["secretKeyRef"], var
        elif var in settings:
            assert compose_defaults(str(value)).get(var, str(value)) == settings[var] or \
                compose_defaults(str(value)) == {var: settings[var]}, var
        else:  # a credential compose takes from the environment: a file from a Secret here
            assert f"{var}_FILE" in env, (name, var)


def test_the_images_are_composes(compose: dict[str, Any], compose_gpu: dict[str, Any],
                                 cpu: Objs, gpu: Objs) -> None:
    pdserve = compose_defaults(compose["x-pdserve"]["image"])["PDSERVE_IMAGE"]
    redis = compose_defaults(compose["services"]["redis"]["image"])["PDSERVE_REDIS_IMAGE"]
    cuda = compose_defaults(compose_gpu["x-gpu-worker"]["image"])["PDSERVE_GPU_IMAGE"]
    for overlay, workers in ((cpu, pdserve), (gpu, cuda)):
        for workload in [*by_kind(overlay, "Deployment").values(), *by_kind(overlay, "StatefulSet").values(),
                         *by_kind(overlay, "Job").values()]:
            name = workload["metadata"]["name"]
            want = (redis if "redis" in name else workers if name in {"pdserve-prefill", "pdserve-decode"}
                    else pdserve)
            for c in pod_spec(workload).get("initContainers", []) + pod_spec(workload)["containers"]:
                assert c["image"] == want, (name, c["name"])
    for name in ("pdserve-prefill", "pdserve-decode"):
        worker = container(by_kind(gpu, "Deployment")[name], "worker")
        assert worker["args"] == compose_gpu["x-gpu-worker"]["command"]


def test_ports_and_health_checks_are_composes(compose: dict[str, Any], cpu: Objs) -> None:
    deployments = by_kind(cpu, "Deployment")
    services = compose["services"]
    for name in ("prefill", "decode"):
        worker = container(deployments[f"pdserve-{name}"], "worker")
        port = int(flags(worker["command"])[1]["--port"])  # type: ignore[arg-type]
        checked = re.search(r"127\.0\.0\.1:(\d+)", " ".join(services[name]["healthcheck"]["test"]))
        assert checked and int(checked.group(1)) == port
        assert worker["readinessProbe"]["grpc"] == {"port": port}  # service "": readiness
        assert worker["startupProbe"]["grpc"] == {"port": port}
        assert worker["livenessProbe"]["grpc"] == {"port": port, "service": _worker_liveness_service()}
    router = container(deployments["pdserve-router"], "router")
    assert re.search(r"127\.0\.0\.1:8000(/\w+)", " ".join(services["router"]["healthcheck"]["test"]))[1] \
        == router["readinessProbe"]["httpGet"]["path"] == "/health"  # type: ignore[index]
    assert services["router"]["ports"] == ["127.0.0.1:${PDSERVE_PORT:-8000}:8000"]
    liveness = int(flags(router["args"])[1]["--liveness-port"])  # type: ignore[arg-type]
    assert router["ports"] == [{"name": "http", "containerPort": 8000},
                               {"name": "liveness", "containerPort": liveness}]
    routes = set(re.findall(r'@router\.get\("([^"]+)"[,)]',
                            (ROOT / "services/router/http/health.py").read_text()))
    assert {"/health", "/livez", "/metrics"} <= routes
    assert router["livenessProbe"]["httpGet"] == {"path": "/livez", "port": liveness}  # off the loop
    store = container(deployments["pdserve-kvstore"], "kvstore")
    assert store["readinessProbe"]["exec"]["command"] == services["kvstore"]["healthcheck"]["test"][1:]


def _worker_liveness_service() -> str:
    from services.worker.server import LIVENESS

    return LIVENESS
