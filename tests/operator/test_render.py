"""Rendering: exact command lines, HPA ownership of replicas, and schema-valid children."""

from __future__ import annotations

import random
from typing import Any

import kubernetes_validate
import pytest

from kvferry.operator.render import render_children
from kvferry.operator.spec import parse_spec
from operator_factories import EXAMPLES, load_example, minimal, random_spec, service

K8S_VERSION = "1.30"


def assert_children_validate(obj: dict[str, Any]) -> list[Any]:
    children = render_children(parse_spec(obj))
    for child in children:
        try:
            kubernetes_validate.validate(child.manifest, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{child.kind}/{child.name}: {exc.message} at {list(exc.path)}") from exc
    return children


def by_name(children: list[Any]) -> dict[str, dict[str, Any]]:
    return {f"{c.kind}/{c.name}": c.manifest for c in children}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_children_validate(path: Any) -> None:
    assert_children_validate(load_example(path))


@pytest.mark.parametrize("seed", range(24))
def test_random_spec_children_validate(seed: int) -> None:
    assert_children_validate(service(random_spec(random.Random(seed)), name=f"svc{seed}"))


def test_validation_catches_a_broken_child() -> None:
    (child, *_) = render_children(parse_spec(service(minimal())))
    broken = {**child.manifest, "data": {"KEY": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_children_of_the_demo_example() -> None:
    children = by_name(render_children(parse_spec(load_example(EXAMPLES[0]))))
    assert list(children) == [
        "ConfigMap/demo-config", "Secret/demo-redis-auth", "Deployment/demo-redis", "Service/demo-redis",
        "Deployment/demo-prefill", "Service/demo-prefill", "PodDisruptionBudget/demo-prefill",
        "Deployment/demo-decode", "Service/demo-decode", "PodDisruptionBudget/demo-decode",
        "Deployment/demo-router", "Service/demo-router",
    ]


def test_serve_command_line_is_the_contract() -> None:
    children = by_name(render_children(parse_spec(load_example(EXAMPLES[1]))))  # llama-gpu
    container = children["Deployment/llama-chat-decode"]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == [
        "kvferry", "serve", "--model", "/models/meta-llama/Llama-3.1-8B-Instruct", "--role", "decode",
        "--host", "0.0.0.0", "--port", "8000",
        "--redis", "redis://:$(REDIS_PASSWORD)@llama-chat-redis.default.svc:6379/0",
        "--served-model-name", "llama-3.1-8b-instruct", "--dtype", "bfloat16", "--block-size", "16",
        "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1", "--max-model-len", "16384",
        "--max-num-seqs", "256", "--max-num-batched-tokens", "8192", "--enable-prefix-caching",
    ]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert [p["containerPort"] for p in container["ports"]] == [8000, 5600]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    router = children["Deployment/llama-chat-router"]["spec"]["template"]["spec"]["containers"][0]
    assert router["args"] == [
        "kvferry", "router", "--service", "llama-chat",
        "--redis", "redis://:$(REDIS_PASSWORD)@llama-chat-redis.default.svc:6379/0",
        "--host", "0.0.0.0", "--port", "8000", "--api-key-file", "/etc/kvferry/api-key/api-key",
    ]


def test_whisper_uses_external_redis_and_an_encoder_pool() -> None:
    children = by_name(render_children(parse_spec(load_example(EXAMPLES[2]))))
    assert "Deployment/whisper-redis" not in children
    encoder = children["Deployment/whisper-encoder"]["spec"]["template"]["spec"]["containers"][0]
    assert encoder["args"][:12] == ["kvferry", "serve", "--model", "openai/whisper-large-v3", "--role",
                                    "encoder", "--host", "0.0.0.0", "--port", "8000", "--redis", "$(REDIS_URL)"]
    assert encoder["env"][0] == {"name": "REDIS_URL",
                                 "valueFrom": {"secretKeyRef": {"name": "shared-redis", "key": "url"}}}


def test_autoscaled_pool_leaves_replicas_to_the_hpa() -> None:
    spec = minimal(pools={"decode": {"replicas": 3, "autoscaling": {"minReplicas": 2, "maxReplicas": 9}}})
    children = by_name(render_children(parse_spec(service(spec))))
    assert "replicas" not in children["Deployment/svc-decode"]["spec"]
    hpa = children["HorizontalPodAutoscaler/svc-decode"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "svc-decode"}
    assert hpa["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": "vllm:num_requests_waiting"},
        "target": {"type": "AverageValue", "averageValue": "4"}}}]
    fixed = by_name(render_children(parse_spec(service(minimal(pools={"decode": {"replicas": 3}})))))
    assert fixed["Deployment/svc-decode"]["spec"]["replicas"] == 3
    assert "HorizontalPodAutoscaler/svc-decode" not in fixed


def test_pods_spread_are_scraped_and_pool_services_are_headless() -> None:
    children = by_name(render_children(parse_spec(service(minimal()))))
    template = children["Deployment/svc-decode"]["spec"]["template"]
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    term = template["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert children["Service/svc-decode"]["spec"]["clusterIP"] == "None"
    assert children["PodDisruptionBudget/svc-decode"]["spec"]["maxUnavailable"] == 1
    assert children["ConfigMap/svc-config"]["data"]["KVFERRY_KV_FAILURE_POLICY"] == "recompute"


def test_ingress_routes_to_the_router() -> None:
    spec = minimal(ingress={"host": "llm.example.com", "className": "nginx", "tls": {"secretName": "t"}})
    ingress = by_name(render_children(parse_spec(service(spec))))["Ingress/svc-router"]["spec"]
    assert ingress["ingressClassName"] == "nginx"
    assert ingress["tls"] == [{"hosts": ["llm.example.com"], "secretName": "t"}]
    (path,) = ingress["rules"][0]["http"]["paths"]
    assert path["backend"] == {"service": {"name": "svc-router", "port": {"name": "http"}}}


def test_rendering_is_deterministic_except_the_generated_password() -> None:
    obj = load_example(EXAMPLES[1])
    first, second = render_children(parse_spec(obj)), render_children(parse_spec(obj))
    assert [c.manifest for c in first if c.kind != "Secret"] == [c.manifest for c in second if c.kind != "Secret"]
    assert [c.create_only for c in first].count(True) == 1
