"""Every object of the kustomize base and both overlays, rendered by the real kubectl, validates
against the Kubernetes API's schemas of the newest release kubernetes-validate ships (strict:
no unknown field anywhere), offline; and the validator does catch mistakes."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from tests.unit.deploy.conftest import LAYOUTS, by_kind, container

# The release the manifests are checked against: the newest that kubernetes-validate ships.
KUBERNETES = "1.37"


def test_the_schemas_are_those_of_a_current_release() -> None:
    assert kubernetes_validate.latest_version().startswith(KUBERNETES)


def validate(obj: dict[str, Any]) -> str:
    return str(kubernetes_validate.validate(obj, KUBERNETES, strict=True))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_rendered_object_is_valid(rendered: dict[str, list[dict[str, Any]]], layout: str) -> None:
    objs = rendered[layout]
    kinds = {o["kind"] for o in objs}
    assert {"Namespace", "ConfigMap", "Deployment", "StatefulSet", "Service", "PodDisruptionBudget",
            "Job", "ServiceAccount", "Role", "RoleBinding"} <= kinds
    for obj in objs:
        assert validate(obj) == KUBERNETES, obj["metadata"]["name"]
        assert obj["kind"] == "Namespace" or obj["metadata"]["namespace"] == "pdserve"


def test_the_secrets_the_script_makes_are_valid(secrets: list[dict[str, Any]]) -> None:
    assert [s["metadata"]["name"] for s in secrets] == [
        "pdserve-store", "pdserve-worker", "pdserve-router", "pdserve-redis", "pdserve-admin"]
    for secret in secrets:
        secret["metadata"].pop("creationTimestamp", None)  # null: kubectl's offline rendering
        assert validate(secret) == KUBERNETES


def test_the_validator_rejects_what_a_cluster_would(cpu: list[dict[str, Any]]) -> None:
    router = by_kind(cpu, "Deployment")["pdserve-router"]
    misspelt = copy.deepcopy(router)
    probe = container(misspelt, "router")["readinessProbe"]
    probe["httpGet"]["paht"] = probe["httpGet"].pop("path")
    wrong_type = copy.deepcopy(router)
    wrong_type["spec"]["replicas"] = "one"
    no_selector = copy.deepcopy(router)
    del no_selector["spec"]["selector"]
    for bad in (misspelt, wrong_type, no_selector):
        with pytest.raises(kubernetes_validate.ValidationError):
            validate(bad)
    made_up = {"apiVersion": "apps/v1", "kind": "Deplyment", "metadata": {"name": "x"}}
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate(made_up)
