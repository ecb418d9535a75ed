"""The Helm chart: `helm lint` and `helm template` output that validates, with the real helm."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvferry.operator.schema import load_crd
from operator_factories import ROOT

CHART = ROOT / "charts" / "kvferry"
ALL_ON = ["--set", "redis.enabled=true", "--set", "redis.existingSecret=redis-auth",
          "--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.prometheusAdapterRules.enabled=true",
          "--set", "operator.watchNamespaces={team-a,team-b}"]


@pytest.fixture(scope="module")
def helm() -> str:
    local = ROOT / ".cache" / "bin" / "helm"
    found = str(local) if local.exists() else shutil.which("helm")
    assert found, "no helm binary: run `bash .ci/install-helm.sh` (puts one in .cache/bin)"
    return found


def run_helm(helm: str, *args: str) -> str:
    done = subprocess.run([helm, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def rendered(helm: str, *values: str) -> list[dict[str, Any]]:
    out = run_helm(helm, "template", "kv", str(CHART), "--namespace", "kvferry-system", "--include-crds", *values)
    return [doc for doc in yaml.safe_load_all(out) if doc]


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
    expected = ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Deployment", "ServiceAccount"]
    assert kinds == (expected if not values else sorted(
        [*expected, "ConfigMap", "Deployment", "Service", "ServiceMonitor"]))


def test_chart_installs_the_crd_from_crds_folder(helm: str) -> None:
    (crd,) = [d for d in rendered(helm) if d["kind"] == "CustomResourceDefinition"]
    assert crd == load_crd()


def test_operator_deployment_and_rbac(helm: str) -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in rendered(helm, *ALL_ON)}
    deployment = docs[("Deployment", "kv-kvferry-operator")]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/kvferry/kvferry:0.1.0"
    assert container["args"] == ["kvferry", "operator", "--liveness", "http://0.0.0.0:8080/healthz",
                                 "--namespace", "team-a", "--namespace", "team-b"]
    rules = docs[("ClusterRole", "kv-kvferry-operator")]["rules"]
    verbs = {(g, r): set(rule["verbs"]) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]}
    assert verbs[("", "secrets")] == {"get", "create"}
    assert not any("delete" in v or "*" in v for v in verbs.values())
    assert verbs[("kvferry.dev", "inferenceservices/status")] == {"get", "patch"}


def test_required_values_fail_loudly(helm: str) -> None:
    done = subprocess.run([helm, "template", "kv", str(CHART), "--set", "redis.enabled=true"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "redis.existingSecret is required" in done.stderr


def test_dockerfile_runs_as_non_root() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "USER 1000" in dockerfile
    assert Path(ROOT / ".dockerignore").exists()
