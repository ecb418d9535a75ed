"""Rendering: exact command lines, HPA ownership of replicas, and schema-valid children."""

from __future__ import annotations

import base64
import random
from typing import Any

import kubernetes_validate
import pytest
from kvferry.kvtransfer.auth import KEY_ENV, MIN_KEY_BYTES
from kvferry.operator.render import render_children
from kvferry.operator.spec import parse_spec
from kvferry_testing.operator_factories import EXAMPLES, load_example, minimal, random_spec, service

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
        "ConfigMap/demo-config", "Secret/demo-kv-transfer-key", "Secret/demo-redis-auth",
        "Deployment/demo-redis", "Service/demo-redis",
        "Deployment/demo-prefill", "Service/demo-prefill", "PodDisruptionBudget/demo-prefill",
        "Deployment/demo-decode", "Service/demo-decode", "PodDisruptionBudget/demo-decode",
        "Deployment/demo-router", "Service/demo-router",
        "NetworkPolicy/demo-engines", "NetworkPolicy/demo-redis",
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
    (whisper,) = [p for p in EXAMPLES if p.stem == "whisper"]
    children = by_name(render_children(parse_spec(load_example(whisper))))
    assert "Deployment/whisper-redis" not in children
    encoder = children["Deployment/whisper-encoder"]["spec"]["template"]["spec"]["containers"][0]
    assert encoder["args"][:12] == ["kvferry", "serve", "--model", "openai/whisper-large-v3", "--role",
                                    "encoder", "--host", "0.0.0.0", "--port", "8000", "--redis", "$(KVFERRY_REDIS_URL)"]
    assert encoder["env"][0] == {"name": "KVFERRY_REDIS_URL",
                                 "valueFrom": {"secretKeyRef": {"name": "shared-redis", "key": "url"}}}


def test_an_encoder_pool_renders_encoder_pods_with_their_own_resources_and_hpa() -> None:
    spec = minimal(model={"source": "demo", "type": "encoder-decoder"}, pools={
        "encoder": {"resources": {"requests": {"cpu": "2", "memory": "1Gi"}},
                    "autoscaling": {"minReplicas": 2, "maxReplicas": 6}},
        "decode": {"replicas": 3, "resources": {"limits": {"nvidia.com/gpu": 1}}}})
    children = by_name(assert_children_validate(service(spec)))
    (encoder,) = pod_of(children, "svc-encoder")["spec"]["containers"]
    assert encoder["args"][4:6] == ["--role", "encoder"]
    assert {e["name"]: e.get("value") for e in encoder["env"]}["KVFERRY_ROLE"] == "encoder"
    assert encoder["resources"] == {"requests": {"cpu": "2", "memory": "1Gi"}}
    assert "replicas" not in children["Deployment/svc-encoder"]["spec"]
    hpa = children["HorizontalPodAutoscaler/svc-encoder"]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 6)
    assert hpa["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": "kvferry:num_requests_waiting_for_encoder"},
        "target": {"type": "AverageValue", "averageValue": "4"}}}]
    # The decode pool keeps its own: a fixed count, a GPU, and the role of a pool that is
    # handed KV (the cross-attention blocks the encoder pool computed).
    (decode,) = pod_of(children, "svc-decode")["spec"]["containers"]
    assert decode["args"][4:6] == ["--role", "decode"]
    assert decode["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    assert children["Deployment/svc-decode"]["spec"]["replicas"] == 3
    assert "HorizontalPodAutoscaler/svc-decode" not in children


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
    # The HPA is applied before the Deployment that stops carrying a count.
    names = list(children)
    assert names.index("HorizontalPodAutoscaler/svc-decode") < names.index("Deployment/svc-decode")


def pod_of(children: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    return children[f"Deployment/{name}"]["spec"]["template"]


PASSTHROUGH = {
    "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
            {"name": "XDG_CACHE_HOME", "value": "/cache/xdg"}],
    "envFrom": [{"secretRef": {"name": "extra"}}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}}},
    "priorityClassName": "inference-high",
    "runtimeClassName": "nvidia",
    "volumes": [{"name": "prompts", "configMap": {"name": "prompts"}},
                {"name": "tmp", "emptyDir": {"sizeLimit": "8Gi"}}],
    "volumeMounts": [{"name": "prompts", "mountPath": "/etc/prompts", "readOnly": True}],
    "imagePullSecrets": ["mirror", "regcred"],
    "podLabels": {"team": "ml", "kvferry.dev/component": "hijack"},
    "podAnnotations": {"example.com/owner": "ml"},
}


def test_pod_passthrough_reaches_the_pool_and_router_pods() -> None:
    spec = minimal(pools={"decode": dict(PASSTHROUGH)}, router=dict(PASSTHROUGH),
                   engine={"imagePullSecrets": ["regcred"]})
    children = by_name(render_children(parse_spec(service(spec))))
    for name, container_name in (("svc-decode", "engine"), ("svc-router", "router")):
        template = pod_of(children, name)
        pod = template["spec"]
        (container,) = pod["containers"]
        assert container["name"] == container_name
        env = {e["name"]: e for e in container["env"]}
        assert env["HF_TOKEN"] == PASSTHROUGH["env"][0]
        assert [e["name"] for e in container["env"]].count("XDG_CACHE_HOME") == 1
        assert container["envFrom"][-1] == {"secretRef": {"name": "extra"}}
        assert container["envFrom"][0] == {"configMapRef": {"name": "svc-config"}}
        assert {"name": "prompts", "mountPath": "/etc/prompts", "readOnly": True} in container["volumeMounts"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["prompts"] == {"name": "prompts", "configMap": {"name": "prompts"}}
        assert volumes["tmp"] == {"name": "tmp", "emptyDir": {"sizeLimit": "8Gi"}}  # replaced, not doubled
        assert [v["name"] for v in pod["volumes"]].count("tmp") == 1
        assert pod["affinity"]["nodeAffinity"] == PASSTHROUGH["affinity"]["nodeAffinity"]
        assert (pod["priorityClassName"], pod["runtimeClassName"]) == ("inference-high", "nvidia")
        assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
        assert template["metadata"]["labels"]["team"] == "ml"
        assert template["metadata"]["labels"]["kvferry.dev/component"] == name.removeprefix("svc-")
        assert template["metadata"]["annotations"]["example.com/owner"] == "ml"
    engine = pod_of(children, "svc-decode")["spec"]
    assert {e["name"]: e.get("value") for e in engine["containers"][0]["env"]}["XDG_CACHE_HOME"] == "/cache/xdg"
    # The default spread across nodes stays beside the passed-through node affinity.
    assert "podAntiAffinity" in engine["affinity"]


def test_rollouts_need_no_spare_gpu_by_default() -> None:
    children = by_name(render_children(parse_spec(service(minimal()))))
    assert children["Deployment/svc-decode"]["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    custom = minimal(pools={"decode": {"strategy": {"maxSurge": "25%", "maxUnavailable": 0}},
                            "prefill": {"strategy": {"type": "Recreate"}}})
    children = by_name(render_children(parse_spec(service(custom))))
    assert children["Deployment/svc-decode"]["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": "25%", "maxUnavailable": 0}
    assert children["Deployment/svc-prefill"]["spec"]["strategy"] == {"type": "Recreate"}


def test_probes_allow_model_loading_and_grace_outlasts_the_drain() -> None:
    spec = minimal(engine={"drainSeconds": 120, "startupSeconds": 3600})
    children = by_name(render_children(parse_spec(service(spec))))
    deployment = children["Deployment/svc-decode"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    startup = container["startupProbe"]
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/ping"
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 120
    assert deployment["spec"]["progressDeadlineSeconds"] > 3600
    assert children["ConfigMap/svc-config"]["data"]["KVFERRY_DRAIN_SECONDS"] == "120"
    assert pod_of(children, "svc-router")["spec"]["terminationGracePeriodSeconds"] > 120
    router = pod_of(children, "svc-router")["spec"]["containers"][0]
    assert (router["readinessProbe"]["httpGet"]["path"], router["livenessProbe"]["httpGet"]["path"]) == (
        "/health", "/ping")


def test_a_cache_claim_becomes_the_hub_cache() -> None:
    spec = minimal(model={"source": "hf://meta-llama/Llama-3.1-8B", "cache": {"claimName": "hub"}})
    pod = pod_of(by_name(render_children(parse_spec(service(spec)))), "svc-decode")["spec"]
    container = pod["containers"][0]
    assert {"name": "hub-cache", "persistentVolumeClaim": {"claimName": "hub"}} in pod["volumes"]
    assert {"name": "hub-cache", "mountPath": "/cache/huggingface"} in container["volumeMounts"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert (env["HF_HOME"], env["KVFERRY_CACHE"]) == ("/cache/huggingface", "/cache/kvferry")
    assert {v["name"]: v for v in pod["volumes"]}["cache"]["emptyDir"] == {"sizeLimit": "64Gi"}


def test_the_config_checksum_follows_the_config_map() -> None:
    def checksums(spec: dict[str, Any]) -> set[str]:
        children = by_name(render_children(parse_spec(service(spec))))
        return {pod_of(children, n)["metadata"]["annotations"]["kvferry.dev/config-checksum"]
                for n in ("svc-decode", "svc-router")}

    base = checksums(minimal())
    assert len(base) == 1  # every pod that reads the ConfigMap carries the same checksum
    assert checksums(minimal(router={"routing": {"decode": "round-robin"}})) != base
    assert checksums(minimal(kvTransfer={"failurePolicy": "fail"})) != base
    assert checksums(minimal(pools={"decode": {"replicas": 5}})) == base


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


def test_rendering_is_deterministic_except_the_generated_secrets() -> None:
    obj = load_example(EXAMPLES[1])
    first, second = render_children(parse_spec(obj)), render_children(parse_spec(obj))
    assert [c.manifest for c in first if c.kind != "Secret"] == [c.manifest for c in second if c.kind != "Secret"]
    # The Redis password and the KV transfer key: generated, created once, never patched.
    assert [c.name for c in first if c.create_only] == ["llama-chat-kv-transfer-key",
                                                    "llama-chat-redis-auth"]


def test_every_engine_pod_reads_the_services_kv_transfer_key() -> None:
    spec = minimal(model={"source": "demo", "type": "encoder-decoder"},
                   pools={"prefill": {}, "decode": {}, "encoder": {}})
    children = by_name(render_children(parse_spec(service(spec))))
    secret = children["Secret/svc-kv-transfer-key"]
    key = base64.b64decode(secret["data"]["key"])
    assert len(key) >= MIN_KEY_BYTES and "annotations" not in secret["metadata"]
    # The router too: it checks the engines' records and KV events in Redis with the key.
    for component in ("encoder", "prefill", "decode", "router"):
        (container,) = pod_of(children, f"svc-{component}")["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env[KEY_ENV] == {"name": KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": "svc-kv-transfer-key", "key": "key"}}}


def test_a_rotation_annotation_marks_the_key_and_rolls_the_pods() -> None:
    def rendered(rotation: str | None) -> dict[str, dict[str, Any]]:
        obj = service(minimal())
        if rotation is not None:
            obj["metadata"]["annotations"] = {"rotation.kvferry.dev/kv-transfer-key": rotation}
        return by_name(render_children(parse_spec(obj)))

    plain, rotated = rendered(None), rendered("2026-11-26")
    assert rotated["Secret/svc-kv-transfer-key"]["metadata"]["annotations"] == {
        "kvferry.dev/generated-for": "2026-11-26"}
    for component in ("svc-decode", "svc-router"):
        annotations = pod_of(rotated, component)["metadata"]["annotations"]
        assert annotations["rotation.kvferry.dev/kv-transfer-key"] == "2026-11-26"
        assert "rotation.kvferry.dev/kv-transfer-key" not in pod_of(plain, component)[
            "metadata"]["annotations"]
