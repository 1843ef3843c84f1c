"""The rendered manifests hang together: the names the plan fixes, every workload probed, sized and
covered by a PodDisruptionBudget, every Service selecting pods, every ConfigMap / Secret / key /
ServiceAccount referenced existing, the preStop drain matching the grace period, RBAC as narrow
as the actuator needs, and the GPU overlay changing only the workers."""

from __future__ import annotations

import re
import subprocess
from typing import Any

import pytest

from tests.unit.deploy.conftest import KUBE, WORKLOADS, by_kind, container, containers, pod_spec

Objs = list[dict[str, Any]]

NAME = "app.kubernetes.io/name"
COMPONENT = "app.kubernetes.io/component"
# Workloads with nothing a probe or PDB can add: the autoscaler serves no port and runs once.
UNPROBED = {"pdserve-autoscaler"}


def workloads(objs: Objs) -> dict[str, dict[str, Any]]:
    return {n: o for kind in WORKLOADS for n, o in by_kind(objs, kind).items()}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_the_names_others_rely_on(cpu: Objs) -> None:
    assert set(by_kind(cpu, "Deployment")) == {"pdserve-router", "pdserve-prefill", "pdserve-decode",
                                               "pdserve-kvstore", "pdserve-autoscaler"}
    assert set(by_kind(cpu, "StatefulSet")) == {"pdserve-redis"}
    services = by_kind(cpu, "Service")
    for name, port, headless in (("pdserve-prefill", 50051, True), ("pdserve-decode", 50061, True),
                                 ("pdserve-kvstore", 50071, True), ("pdserve-router", 8000, False),
                                 ("pdserve-redis", 6379, True)):
        spec = services[name]["spec"]
        assert (spec.get("clusterIP") == "None") == headless, name
        assert spec["ports"][0]["port"] == spec["ports"][0]["targetPort"] == port
    for name, workload in workloads(cpu).items():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert labels[NAME] == "pdserve" and labels[COMPONENT] == name.removeprefix("pdserve-")
        assert workload["spec"]["selector"]["matchLabels"] == {NAME: "pdserve", COMPONENT: labels[COMPONENT]}


def test_every_workload_is_probed_sized_and_budgeted(cpu: Objs) -> None:
    pdbs = by_kind(cpu, "PodDisruptionBudget").values()
    for name, workload in workloads(cpu).items():
        for c in containers(workload):
            assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"], c["name"]
            assert c["resources"]["limits"]["memory"], c["name"]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        covering = [p for p in pdbs if selects(p["spec"]["selector"]["matchLabels"], labels)]
        if name in UNPROBED:
            assert not covering
            continue
        main = pod_spec(workload)["containers"][0]
        assert "readinessProbe" in main and "livenessProbe" in main, name
        assert len(covering) == 1 and covering[0]["spec"]["maxUnavailable"] == 1, name


def test_every_service_selects_a_workload_on_its_ports(cpu: Objs) -> None:
    for name, service in by_kind(cpu, "Service").items():
        matched = [w for w in workloads(cpu).values()
                   if selects(service["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]
        assert len(matched) == 1, name
        ports = {p["containerPort"] for c in containers(matched[0], init=False) for p in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports, name


def test_every_reference_exists(cpu: Objs, secrets: Objs) -> None:
    config_maps = by_kind(cpu, "ConfigMap")
    made = {s["metadata"]["name"]: set(s["data"]) for s in secrets}
    optional = {"pdserve-api-keys"}  # the client API keys: none means an open API, as in compose
    accounts = by_kind(cpu, "ServiceAccount")
    pod_kinds = [*workloads(cpu).values(), *by_kind(cpu, "Job").values()]
    for workload in pod_kinds:
        spec = pod_spec(workload)
        assert spec.get("serviceAccountName", "default") in {*accounts, "default"}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        templates = workload["spec"].get("volumeClaimTemplates", [])
        claims = {t["metadata"]["name"]: {"claim": t} for t in templates}
        assert not volumes.keys() & claims.keys()
        volumes |= claims
        for v in volumes.values():
            if "configMap" in v:
                assert v["configMap"]["name"] in config_maps
            if "secret" in v:
                assert v["secret"]["secretName"] in made and v["secret"]["defaultMode"] == 0o440
        for c in containers(workload):
            for source in c.get("envFrom", []):
                assert source["configMapRef"]["name"] in config_maps
            mounts = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", [])}
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert (ref["name"] in optional and ref["optional"]) or ref["key"] in made[ref["name"]]
                if env["name"].endswith("_FILE"):  # a credential file: in a mounted Secret's keys
                    folder, _, key = env["value"].rpartition("/")
                    secret = mounts[folder]["secret"]["secretName"]
                    assert key in made[secret], (workload["metadata"]["name"], env["name"])
    binding = by_kind(cpu, "RoleBinding")["pdserve-autoscaler"]
    assert binding["roleRef"]["name"] in by_kind(cpu, "Role")
    assert binding["subjects"][0]["name"] in accounts


def test_the_autoscaler_may_scale_and_drain_the_pools_and_nothing_else(cpu: Objs) -> None:
    rules = by_kind(cpu, "Role")["pdserve-autoscaler"]["rules"]
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    assert granted == {("apps", "deployments", "get"), ("apps", "deployments/scale", "get"),
                       ("apps", "deployments/scale", "patch"), ("apps", "deployments/scale", "update"),
                       ("", "pods", "list"), ("", "pods", "get"), ("", "pods", "patch")}
    for rule in rules:
        if rule["apiGroups"] == ["apps"]:
            assert set(rule["resourceNames"]) == {"pdserve-prefill", "pdserve-decode"}
    deployment = by_kind(cpu, "Deployment")["pdserve-autoscaler"]
    assert pod_spec(deployment)["serviceAccountName"] == "pdserve-autoscaler"
    assert deployment["spec"]["replicas"] == 1


@pytest.mark.parametrize("role,port", [("prefill", 50051), ("decode", 50061)])
def test_a_worker_drains_through_every_router_within_its_grace(cpu: Objs, role: str,
                                                                port: int) -> None:
    workload = by_kind(cpu, "Deployment")[f"pdserve-{role}"]
    worker = container(workload, "worker")
    script = worker["lifecycle"]["preStop"]["exec"]["command"]
    assert script[:2] == ["sh", "-c"]
    m = re.fullmatch(r'exec pdserve drain --router dns:(\S+):8000 --role (\w+) '
                     r'--target "\$POD_IP:(\d+)" --timeout-s (\d+)', script[2])
    assert m, script[2]
    service, drained_role, target_port, timeout = m.groups()
    assert (drained_role, int(target_port)) == (role, port)
    admin = by_kind(cpu, "Service")[service]["spec"]
    assert admin["clusterIP"] == "None" and admin["publishNotReadyAddresses"]  # every router
    assert admin["selector"][COMPONENT] == "router"
    env = {e["name"]: e for e in worker["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "PDSERVE_ADMIN_API_KEY_FILE" in env
    # the drain, then the worker's own graceful stop (--grace-s 10), inside the grace period
    assert int(timeout) + 10 < pod_spec(workload)["terminationGracePeriodSeconds"]


def test_metrics_are_announced_where_they_are_served(cpu: Objs) -> None:
    for name, workload in workloads(cpu).items():
        notes = workload["spec"]["template"]["metadata"].get("annotations", {})
        if name in {"pdserve-autoscaler", "pdserve-redis"}:  # nothing served over HTTP
            assert "prometheus.io/scrape" not in notes
            continue
        assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
        main = pod_spec(workload)["containers"][0]
        port = int(notes["prometheus.io/port"])
        assert port in {p["containerPort"] for p in main["ports"]}
        args = main.get("command", []) + main.get("args", [])
        if name == "pdserve-router":
            assert port == 8000
        else:
            assert args[args.index("--metrics-port") + 1] == str(port)


def test_the_gpu_overlay_changes_the_workers_only(cpu: Objs, gpu: Objs) -> None:
    cpu_by = {(o["kind"], o["metadata"]["name"]): o for o in cpu}
    gpu_by = {(o["kind"], o["metadata"]["name"]): o for o in gpu}
    assert cpu_by.keys() == gpu_by.keys()
    changed = {k for k in cpu_by if cpu_by[k] != gpu_by[k]}
    assert changed == {("Deployment", "pdserve-prefill"), ("Deployment", "pdserve-decode")}
    for key in changed:
        for overlay, device in ((cpu_by[key], "cpu"), (gpu_by[key], "cuda")):
            worker = container(overlay, "worker")
            assert worker["args"] == ["--device", device]
            gpus = {k: v for k, v in worker["resources"].get("limits", {}).items() if k == "nvidia.com/gpu"}
            assert gpus == ({"nvidia.com/gpu": 1} if device == "cuda" else {})
        # no surge pod waiting for a spare GPU in a rollout
        assert gpu_by[key]["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


def test_the_redis_scripts_parse() -> None:
    for script in sorted((KUBE / "base" / "scripts").glob("*.sh")):
        out = subprocess.run(["sh", "-n", str(script)], capture_output=True, text=True, check=False)
        assert out.returncode == 0, (script.name, out.stderr)
    out = subprocess.run(["bash", "-n", str(KUBE / "secrets.sh")], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr
