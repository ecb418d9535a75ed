"""Render the NetworkPolicies that fence an InferenceService's engines and Redis in.

Engine pods (every pool) admit connections from the pods of their own service only: the
router and the other pools. Every port is open to those peers, not just HTTP and the side
channel: NIXL's UCX transport connects to ephemeral ports. Prometheus, when
`spec.networkPolicy.metrics` names where it runs, reaches the HTTP port (where /metrics is
served). The managed Redis admits the service's pods on its port. The router is the
service's public endpoint (behind the Ingress), so no policy restricts it.
"""

from __future__ import annotations

from typing import Any

from kvferry.operator.labels import (
    COMPONENT_LABEL,
    HTTP_PORT,
    REDIS_PORT,
    SERVICE_LABEL,
    child_name,
    labels,
)
from kvferry.operator.spec import InferenceServiceSpec


def render_network_policies(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The service's NetworkPolicies; none when `spec.networkPolicy.enabled` is false."""
    if not spec.network_policy.enabled:
        return []
    policies = [_engine_policy(spec)]
    if spec.redis.is_managed:
        policies.append(_redis_policy(spec))
    return policies


def _same_service(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The peer of every pod of this service (same namespace: a bare podSelector)."""
    return {"podSelector": {"matchLabels": {SERVICE_LABEL: spec.name}}}


def _policy(spec: InferenceServiceSpec, component: str, pod_selector: dict[str, Any],
            ingress: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": child_name(spec.name, component), "namespace": spec.namespace,
                     "labels": labels(spec.name, component)},
        "spec": {"podSelector": pod_selector, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def _engine_policy(spec: InferenceServiceSpec) -> dict[str, Any]:
    selector = {
        "matchLabels": {SERVICE_LABEL: spec.name},
        "matchExpressions": [
            {"key": COMPONENT_LABEL, "operator": "In", "values": list(spec.pools)},
        ],
    }
    ingress: list[dict[str, Any]] = [{"from": [_same_service(spec)]}]
    peer = spec.network_policy.metrics_peer
    if peer is not None:
        ingress.append({"from": [dict(peer)], "ports": [{"protocol": "TCP", "port": HTTP_PORT}]})
    return _policy(spec, "engines", selector, ingress)


def _redis_policy(spec: InferenceServiceSpec) -> dict[str, Any]:
    selector = {"matchLabels": {SERVICE_LABEL: spec.name, COMPONENT_LABEL: "redis"}}
    ingress = [{"from": [_same_service(spec)], "ports": [{"protocol": "TCP", "port": REDIS_PORT}]}]
    return _policy(spec, "redis", selector, ingress)
