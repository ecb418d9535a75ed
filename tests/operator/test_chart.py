"""The Helm chart: `helm lint` and `helm template` output that validates, with the real helm."""

from __future__ import annotations

import subprocess
from pathlib import Path

import kubernetes_validate
import pytest

from kvferry_testing.chart import ALL_ON, CHART, rendered, run_helm
from kvferry.operator.schema import load_crd
from kvferry_testing.operator_factories import ROOT


def test_helm_lint_passes(helm: str) -> None:
    run_helm(helm, "lint", "--strict", str(CHART))
    run_helm(helm, "lint", "--strict", str(CHART), *ALL_ON)


@pytest.mark.parametrize("values", [[], ALL_ON], ids=["defaults", "everything-on"])
def test_helm_template_validates(helm: str, values: list[str]) -> None:
    docs = rendered(helm, *values)
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":  # a prometheus-operator CRD, not in the 1.30 schemas
            assert doc["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/managed-by": "kvferry-operator"}
            continue
        kubernetes_validate.validate(doc, "1.30", strict=True)
    kinds = sorted(d["kind"] for d in docs)
    if not values:
        assert kinds == ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Deployment",
                         "ServiceAccount"]
    else:  # a Role and RoleBinding per watched namespace, nothing cluster-wide
        assert kinds == sorted(["ConfigMap", "CustomResourceDefinition", "Deployment", "Deployment", "Role",
                                "Role", "RoleBinding", "RoleBinding", "Service", "ServiceAccount",
                                "ServiceMonitor"])


def test_chart_installs_the_crd_from_crds_folder(helm: str) -> None:
    (crd,) = [d for d in rendered(helm) if d["kind"] == "CustomResourceDefinition"]
    assert crd == load_crd()


def test_operator_deployment_and_rbac(helm: str) -> None:
    docs = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in rendered(helm, *ALL_ON)}
    deployment = docs[("Deployment", "kvferry-system", "kv-kvferry-operator")]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/kvferry/kvferry:0.1.0"
    assert container["args"] == ["kvferry", "operator", "--liveness", "http://0.0.0.0:8080/healthz",
                                 "--namespace", "team-a", "--namespace", "team-b", "--allow-host-path"]
    for namespace in ("team-a", "team-b"):
        rules = docs[("Role", namespace, "kv-kvferry-operator")]["rules"]
        verbs = {(g, r): set(rule["verbs"]) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]}
        assert verbs[("", "secrets")] == {"get", "create", "delete"}  # never list or watch
        assert "delete" not in verbs[("", "configmaps")]
        assert not any("*" in v for v in verbs.values())
        binding = docs[("RoleBinding", namespace, "kv-kvferry-operator")]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kv-kvferry-operator",
                                        "namespace": "kvferry-system"}]
    default_args = [d for d in rendered(helm) if d["kind"] == "Deployment"][0]["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert "--allow-host-path" not in default_args


def test_required_values_fail_loudly(helm: str) -> None:
    done = subprocess.run([helm, "template", "kv", str(CHART), "--set", "redis.enabled=true"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "redis.existingSecret is required" in done.stderr


def test_dockerfile_runs_as_non_root() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "USER 1000" in dockerfile
    assert Path(ROOT / ".dockerignore").exists()
