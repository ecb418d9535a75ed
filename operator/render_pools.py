"""Render one engine pool: Deployment, headless Service, PodDisruptionBudget and HPA."""

from __future__ import annotations

from typing import Any

from kvferry.operator.labels import (
    HTTP_PORT,
    NIXL_PORT,
    child_name,
    labels,
    scrape_annotations,
    selector_labels,
)
from kvferry.operator.spec import InferenceServiceSpec, PoolSpec, Resources

MODEL_MOUNT = "/models"


def serve_args(spec: InferenceServiceSpec, pool: PoolSpec, redis_url: str) -> list[str]:
    """The `kvferry serve` command line of one pool's pods (the contract of ARCHITECTURE.md)."""
    e = spec.engine
    args = [
        "kvferry", "serve",
        "--model", model_arg(spec),
        "--role", pool.role,
        "--host", "0.0.0.0",
        "--port", str(HTTP_PORT),
        "--redis", redis_url,
        "--served-model-name", spec.model.served_name,
        "--dtype", spec.model.dtype,
        "--block-size", str(e.block_size),
        "--tensor-parallel-size", str(e.tensor_parallel_size),
        "--pipeline-parallel-size", str(e.pipeline_parallel_size),
    ]
    optional = [
        ("--max-model-len", spec.model.max_model_len),
        ("--max-num-seqs", e.max_num_seqs),
        ("--max-num-batched-tokens", e.max_num_batched_tokens),
    ]
    args += [x for flag, value in optional if value is not None for x in (flag, str(value))]
    args += ["--enable-prefix-caching"] if e.enable_prefix_caching else []
    args += ["--enable-prompt-embeds"] if e.enable_prompt_embeds else []
    return args + list(e.extra_args)


def model_arg(spec: InferenceServiceSpec) -> str:
    """`--model`: `demo`, the hub id, or the directory where the weights are mounted."""
    scheme, path = spec.model.source_scheme, spec.model.source_path
    if scheme == "demo":
        return "demo"
    if scheme == "hf":
        return path
    if scheme == "pvc":
        _, _, sub = path.partition("/")
        return f"{MODEL_MOUNT}/{sub}".rstrip("/")
    return MODEL_MOUNT


def model_volumes(spec: InferenceServiceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts) that make the weights visible at `model_arg`."""
    scheme, path = spec.model.source_scheme, spec.model.source_path
    if scheme == "pvc":
        claim = path.partition("/")[0]
        source = {"persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    elif scheme == "hostpath":
        source = {"hostPath": {"path": path, "type": "Directory"}}
    elif scheme == "hf":
        # Hub downloads land in a pod-local cache.
        return [{"name": "hf-cache", "emptyDir": {}}], [{"name": "hf-cache", "mountPath": "/cache"}]
    else:
        return [], []
    return ([{"name": "model", **source}],
            [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}])


def resources_manifest(resources: Resources) -> dict[str, Any]:
    """A container's `resources` (empty maps left out)."""
    out: dict[str, Any] = {}
    if resources.requests:
        out["requests"] = dict(resources.requests)
    if resources.limits:
        out["limits"] = dict(resources.limits)
    return out


def health_probes() -> dict[str, Any]:
    """Startup, readiness and liveness probes on `GET /health` (model loading may take minutes)."""
    get = {"httpGet": {"path": "/health", "port": "http"}}
    return {
        "startupProbe": {**get, "periodSeconds": 10, "failureThreshold": 90},
        "readinessProbe": {**get, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**get, "periodSeconds": 15, "failureThreshold": 4},
    }


def pod_spec_common(spec: InferenceServiceSpec) -> dict[str, Any]:
    """Pod-level fields every kvferry pod shares: pull secrets and a non-root context."""
    out: dict[str, Any] = {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000},
    }
    if spec.engine.image_pull_secrets:
        out["imagePullSecrets"] = [{"name": n} for n in spec.engine.image_pull_secrets]
    return out


def _engine_container(spec: InferenceServiceSpec, pool: PoolSpec, redis_url: str,
                      env: list[dict[str, Any]], config_map: str) -> dict[str, Any]:
    _, mounts = model_volumes(spec)
    hf_env = [{"name": "HF_HOME", "value": "/cache"}] if spec.model.source_scheme == "hf" else []
    return {
        "name": "engine",
        "image": spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "args": serve_args(spec, pool, redis_url),
        "ports": [
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "nixl", "containerPort": NIXL_PORT, "protocol": "TCP"},
        ],
        "env": [*env, *hf_env, {"name": "KVFERRY_ROLE", "value": pool.role},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "envFrom": [{"configMapRef": {"name": config_map}}],
        "resources": resources_manifest(pool.resources),
        "volumeMounts": [*mounts, {"name": "shm", "mountPath": "/dev/shm"}],
        **health_probes(),
    }


def render_deployment(spec: InferenceServiceSpec, pool: PoolSpec, redis_url: str,
                      env: list[dict[str, Any]], config_map: str) -> dict[str, Any]:
    """The pool's Deployment; without `spec.replicas` when an HPA owns the count."""
    component = pool.name
    volumes, _ = model_volumes(spec)
    pod_labels = labels(spec.name, component)
    anti_affinity = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100,
        "podAffinityTerm": {
            "labelSelector": {"matchLabels": selector_labels(spec.name, component)},
            "topologyKey": "kubernetes.io/hostname",
        },
    }]}}
    pod: dict[str, Any] = {
        **pod_spec_common(spec),
        "containers": [_engine_container(spec, pool, redis_url, env, config_map)],
        "volumes": [*volumes, {"name": "shm", "emptyDir": {"medium": "Memory"}}],
        "affinity": anti_affinity,
        "terminationGracePeriodSeconds": 60,
    }
    if pool.node_selector:
        pod["nodeSelector"] = dict(pool.node_selector)
    if pool.tolerations:
        pod["tolerations"] = [dict(t) for t in pool.tolerations]
    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(spec.name, component)},
        "template": {
            "metadata": {
                "labels": pod_labels,
                "annotations": scrape_annotations(),
            },
            "spec": pod,
        },
    }
    if pool.autoscaling is None:
        deployment_spec = {"replicas": pool.replicas, **deployment_spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": child_name(spec.name, component), "labels": pod_labels},
        "spec": deployment_spec,
    }


def render_headless_service(spec: InferenceServiceSpec, pool: PoolSpec) -> dict[str, Any]:
    """A headless Service: stable DNS for every pod of the pool, HTTP and NIXL ports."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": child_name(spec.name, pool.name), "labels": labels(spec.name, pool.name)},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": selector_labels(spec.name, pool.name),
            "ports": [
                {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                {"name": "nixl", "port": NIXL_PORT, "targetPort": "nixl", "protocol": "TCP"},
            ],
        },
    }


def render_pdb(spec: InferenceServiceSpec, pool: PoolSpec) -> dict[str, Any]:
    """Voluntary disruptions (drains) take at most one pod of the pool at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": child_name(spec.name, pool.name), "labels": labels(spec.name, pool.name)},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(spec.name, pool.name)}},
    }


def render_hpa(spec: InferenceServiceSpec, pool: PoolSpec) -> dict[str, Any]:
    """An autoscaling/v2 HPA on per-pod engine metrics (Pods metrics via prometheus-adapter)."""
    if pool.autoscaling is None:
        raise ValueError(f"spec.pools.{pool.name}.autoscaling: render_hpa needs it set")
    scaling = pool.autoscaling
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": child_name(spec.name, pool.name), "labels": labels(spec.name, pool.name)},
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "apps/v1", "kind": "Deployment", "name": child_name(spec.name, pool.name),
            },
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": [{
                "type": "Pods",
                "pods": {
                    "metric": {"name": m.name},
                    "target": {"type": "AverageValue", "averageValue": m.target_average_value},
                },
            } for m in scaling.metrics],
        },
    }


def render_pool(spec: InferenceServiceSpec, pool: PoolSpec, redis_url: str,
                env: list[dict[str, Any]], config_map: str) -> list[dict[str, Any]]:
    """All children of one pool, the HPA only when the pool autoscales."""
    out = [
        render_deployment(spec, pool, redis_url, env, config_map),
        render_headless_service(spec, pool),
        render_pdb(spec, pool),
    ]
    if pool.autoscaling is not None:
        out.append(render_hpa(spec, pool))
    return out
