"""Rendering the Helm chart with the real helm binary (for the chart and pod-security tests)."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import yaml

from kvferry_testing.operator_factories import ROOT

CHART = ROOT / "charts" / "kvferry"
ALL_ON = ["--set", "redis.enabled=true", "--set", "redis.existingSecret=redis-auth",
          "--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.prometheusAdapterRules.enabled=true",
          "--set", "operator.watchNamespaces={team-a,team-b}", "--set", "operator.allowHostPath=true"]


def helm_binary() -> str:
    """The helm of `.ci/install-helm.sh`, else one on PATH."""
    local = ROOT / ".cache" / "bin" / "helm"
    found = str(local) if local.exists() else shutil.which("helm")
    assert found, "no helm binary: run `bash .ci/install-helm.sh` (puts one in .cache/bin)"
    return found


def run_helm(helm: str, *args: str) -> str:
    done = subprocess.run([helm, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def rendered(helm: str, *values: str) -> list[dict[str, Any]]:
    """The chart's objects (CRD included) as `helm template` renders them."""
    out = run_helm(helm, "template", "kv", str(CHART), "--namespace", "kvferry-system", "--include-crds", *values)
    return [doc for doc in yaml.safe_load_all(out) if doc]
