"""NetworkPolicies: only the service's own pods reach its engines and its managed Redis."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from kvferry.operator.render import render_children
from kvferry.operator.spec import SpecError, parse_spec
from kvferry_testing.operator_factories import EXAMPLES, load_example, minimal, service

K8S_VERSION = "1.30"


def policies(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    children = render_children(parse_spec(manifest))
    return {c.manifest["metadata"]["name"]: c.manifest for c in children
            if c.kind == "NetworkPolicy"}


def test_the_demo_service_fences_its_engines_and_redis() -> None:
    found = policies(load_example(EXAMPLES[0]))  # demo: prefill and decode pools, managed Redis
    assert list(found) == ["demo-engines", "demo-redis"]
    engines = found["demo-engines"]["spec"]
    assert engines == {
        "podSelector": {
            "matchLabels": {"kvferry.dev/service": "demo"},
            "matchExpressions": [{"key": "kvferry.dev/component", "operator": "In",
                                  "values": ["prefill", "decode"]}],
        },
        "policyTypes": ["Ingress"],
        # The service's own pods (router, other pools) on every port: NIXL's UCX transport
        # connects to ephemeral ports. Nobody else.
        "ingress": [{"from": [{"podSelector": {"matchLabels": {"kvferry.dev/service": "demo"}}}]}],
    }
    assert found["demo-redis"]["spec"] == {
        "podSelector": {"matchLabels": {"kvferry.dev/service": "demo",
                                        "kvferry.dev/component": "redis"}},
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": {"matchLabels": {"kvferry.dev/service": "demo"}}}],
                     "ports": [{"protocol": "TCP", "port": 6379}]}],
    }
    for manifest in found.values():
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def test_prometheus_reaches_only_the_http_port() -> None:
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app": "prometheus"}}}
    spec = minimal(networkPolicy={"metrics": peer}, redis={"url": "redis://shared:6379/0"})
    found = policies(service(spec, name="chat"))
    assert list(found) == ["chat-engines"]  # no managed Redis, no Redis policy
    rules = found["chat-engines"]["spec"]["ingress"]
    assert rules[1] == {"from": [peer], "ports": [{"protocol": "TCP", "port": 8000}]}
    kubernetes_validate.validate(found["chat-engines"], K8S_VERSION, strict=True)


def test_disabled_renders_none() -> None:
    assert policies(service(minimal(networkPolicy={"enabled": False}))) == {}


def test_a_metrics_peer_needs_a_selector() -> None:
    with pytest.raises(SpecError, match="needs a namespaceSelector, a podSelector or both"):
        parse_spec(service(minimal(networkPolicy={"metrics": {}})))
