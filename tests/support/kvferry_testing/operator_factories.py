"""Small factories of InferenceService manifests for the operator tests."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def load_example(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def service(spec: dict[str, Any], name: str = "svc", namespace: str = "team-a") -> dict[str, Any]:
    return {"apiVersion": "kvferry.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def minimal(**overrides: Any) -> dict[str, Any]:
    """The smallest valid spec (demo model, one decode pool) with top-level overrides."""
    return {"model": {"source": "demo"}, "pools": {"decode": {}}, **overrides}


def pod_passthrough(rng: random.Random) -> dict[str, Any]:
    """Pod-template passthrough fields, each present with some probability."""
    fields: dict[str, Any] = {
        "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
                {"name": "LOG_LEVEL", "value": "debug"}],
        "envFrom": [{"secretRef": {"name": "extra-env"}}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100", "h100"]}]}]}}},
        "priorityClassName": "inference-high",
        "runtimeClassName": "nvidia",
        "volumes": [{"name": "prompts", "configMap": {"name": "prompts"}}],
        "volumeMounts": [{"name": "prompts", "mountPath": "/etc/prompts", "readOnly": True}],
        "imagePullSecrets": ["mirror-creds"],
        "podLabels": {"team": "ml"},
        "podAnnotations": {"example.com/owner": "ml-platform"},
    }
    return {k: v for k, v in fields.items() if rng.random() < 0.5}


def _pool(rng: random.Random, gpus_per_replica: int) -> dict[str, Any]:
    pool: dict[str, Any] = {"replicas": rng.randint(0, 8)}
    if rng.random() < 0.6:
        gpus = gpus_per_replica * rng.choice([1, 2])
        pool["resources"] = {"requests": {"cpu": rng.choice(["500m", "2", 4]), "memory": "8Gi"},
                             "limits": {"nvidia.com/gpu": gpus, "memory": "16Gi"}}
    if rng.random() < 0.4:
        pool["nodeSelector"] = {"kvferry.dev/pool": "gpu", "zone": rng.choice(["a", "b"])}
    if rng.random() < 0.4:
        pool["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                               {"key": "spot", "operator": "Equal", "value": "true",
                                "effect": "NoExecute", "tolerationSeconds": 30}]
    if rng.random() < 0.5:
        low = rng.randint(1, 4)
        scaling: dict[str, Any] = {"minReplicas": low, "maxReplicas": low + rng.randint(0, 20)}
        if rng.random() < 0.5:
            scaling["metrics"] = [{"name": "vllm:num_requests_running", "targetAverageValue": rng.randint(1, 64)},
                                  {"name": "vllm:kv_cache_usage_perc", "targetAverageValue": "750m"}]
        pool["autoscaling"] = scaling
    if rng.random() < 0.5:
        pool.update(pod_passthrough(rng))
    if rng.random() < 0.3:
        pool["strategy"] = rng.choice([{"type": "Recreate"}, {"maxSurge": "25%", "maxUnavailable": 0}])
    return pool


def random_spec(rng: random.Random) -> dict[str, Any]:
    """A random spec that the CRD accepts, touching every optional part with some probability."""
    enc_dec = rng.random() < 0.3
    source = rng.choice(["demo", "hf://org/model-1b", "pvc://weights/llama/8b", "hostpath:///mnt/models/x"])
    # Encoder-decoder models run without parallelism (the CRD refuses it).
    tensor_parallel = 1 if enc_dec else rng.choice([1, 2, 4])
    spec: dict[str, Any] = {
        "model": {"source": source, "type": "encoder-decoder" if enc_dec else "decoder-only",
                  "dtype": rng.choice(["auto", "float16", "bfloat16", "float32"])},
        "pools": {"decode": _pool(rng, tensor_parallel)},
        "engine": {"blockSize": rng.choice([8, 16, 32]), "enablePrefixCaching": rng.random() < 0.5,
                   "enablePromptEmbeds": rng.random() < 0.3, "tensorParallelSize": tensor_parallel,
                   "extraArgs": ["--seed", str(rng.randint(0, 9))]},
    }
    if rng.random() < 0.5:
        spec["model"]["maxModelLen"] = rng.choice([2048, 32768])
        spec["engine"]["maxNumSeqs"] = rng.randint(1, 512)
        spec["engine"]["maxNumBatchedTokens"] = rng.choice([2048, 8192])
        spec["engine"]["imagePullSecrets"] = ["regcred"]
    if rng.random() < 0.6:
        spec["pools"]["prefill"] = _pool(rng, tensor_parallel)
    if enc_dec and rng.random() < 0.7:
        spec["pools"]["encoder"] = _pool(rng, tensor_parallel)
    if rng.random() < 0.5:
        spec["router"] = {"replicas": rng.randint(1, 3), "apiKeySecret": {"name": "keys"},
                          **pod_passthrough(rng)}
    if rng.random() < 0.3:
        spec["model"]["cache"] = {"claimName": "hub-cache", "sizeLimit": rng.choice(["100Gi", "0.5Ti", 2**40])}
        spec["engine"]["drainSeconds"] = rng.randint(0, 600)
        spec["engine"]["shmSize"] = rng.choice(["1Gi", "4096Mi"])
    if rng.random() < 0.5:
        spec["ingress"] = {"host": "llm.example.com", "className": "nginx"}
        if rng.random() < 0.5:
            spec["ingress"]["tls"] = {"secretName": "llm-tls"}
    redis = rng.choice([{}, {"url": "redis://shared:6379/0"}, {"urlSecret": {"name": "redis-url"}}])
    if redis:
        spec["redis"] = redis
    if rng.random() < 0.5:
        spec["kvTransfer"] = {"leaseSeconds": rng.randint(1, 600), "failurePolicy": rng.choice(["recompute", "fail"])}
    if rng.random() < 0.5:
        spec["networkPolicy"] = rng.choice([
            {"enabled": False},
            {"metrics": {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}},
            {"metrics": {"namespaceSelector": {}, "podSelector": {
                "matchExpressions": [{"key": "app", "operator": "In", "values": ["prometheus"]}]}}},
        ])
    return spec
