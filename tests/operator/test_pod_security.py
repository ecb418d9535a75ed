"""Every pod the operator and the chart create meets the `restricted` Pod Security level."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from kvferry_testing.chart import ALL_ON, rendered
from kvferry.operator.render import render_children
from kvferry.operator.spec import parse_spec
from kvferry_testing.operator_factories import EXAMPLES, load_example, minimal, random_spec, service
from kvferry_testing.pod_security import restricted_violations

SPECS = [load_example(p) for p in EXAMPLES] + [
    service(random_spec(random.Random(seed)), name=f"svc{seed}") for seed in range(24)]


def pods(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c.name: c.manifest["spec"]["template"]["spec"]
            for c in render_children(parse_spec(obj)) if c.kind == "Deployment"}


@pytest.mark.parametrize("obj", SPECS, ids=lambda o: o["metadata"]["name"])
def test_every_operator_pod_is_restricted(obj: dict[str, Any]) -> None:
    is_host_path = parse_spec(obj).model.source_scheme == "hostpath"
    for name, pod in pods(obj).items():
        violations = restricted_violations(pod)
        if is_host_path and name.rsplit("-", 1)[-1] in ("encoder", "prefill", "decode"):
            # The one exception, refused unless the operator is installed to allow it.
            assert violations == ["spec.volumes[model]: hostPath", "spec.volumes[model]: type ['hostPath']"]
        else:
            assert violations == [], name


@pytest.mark.parametrize("values", [[], ALL_ON], ids=["defaults", "everything-on"])
def test_every_chart_pod_is_restricted(helm: str, values: list[str]) -> None:
    deployments = [d for d in rendered(helm, *values) if d["kind"] == "Deployment"]
    assert len(deployments) == (2 if values else 1)  # the operator, and the shared Redis
    for deployment in deployments:
        assert restricted_violations(deployment["spec"]["template"]["spec"]) == [], deployment["metadata"]["name"]


def test_the_check_catches_what_restricted_forbids() -> None:
    pod = pods(service(minimal()))["svc-decode"]
    assert restricted_violations(pod) == []
    broken = copy.deepcopy(pod)
    container = broken["containers"][0]
    del container["securityContext"]["allowPrivilegeEscalation"]
    container["securityContext"]["capabilities"] = {"add": ["SYS_ADMIN"]}
    del broken["securityContext"]["seccompProfile"]
    broken["securityContext"]["runAsNonRoot"] = False
    container["securityContext"]["readOnlyRootFilesystem"] = False
    broken["volumes"].append({"name": "scratch", "emptyDir": {}})
    broken["hostNetwork"] = True
    assert restricted_violations(broken) == [
        "spec.hostNetwork",
        "containers[engine]: adds capability SYS_ADMIN",
        "containers[engine]: allowPrivilegeEscalation is not false",
        "containers[engine]: runAsNonRoot is not true",
        "containers[engine]: seccompProfile is None, not RuntimeDefault or Localhost",
        "containers[engine]: capabilities do not drop ALL",
        "containers[engine]: adds capability SYS_ADMIN",
        "containers[engine]: root filesystem is writable",
        "spec.volumes[scratch]: emptyDir without sizeLimit",
    ]
