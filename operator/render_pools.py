"""Render one engine pool: HPA, Deployment, headless Service and PodDisruptionBudget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvferry.operator.images import engine_image
from kvferry.operator.labels import (
    HTTP_PORT,
    NIXL_PORT,
    child_name,
    labels,
    scrape_annotations,
    selector_labels,
)
from kvferry.operator.render_kv_key import kv_transfer_key_annotations, kv_transfer_key_env
from kvferry.operator.render_pod import (
    CONFIG_CHECKSUM_ANNOTATION,
    TMP_SIZE_LIMIT,
    apply_overrides,
    container_security_context,
    empty_dir,
    http_probes,
    pod_metadata,
    pod_security_context,
    resources_manifest,
)
from kvferry.operator.spec import InferenceServiceSpec, PoolSpec, RolloutStrategy

MODEL_MOUNT = "/models"
CACHE_MOUNT = "/cache"
HUB_CACHE = f"{CACHE_MOUNT}/huggingface"
RUN_AS_USER = 1000  # the image's kvferry user
SHUTDOWN_MARGIN_SECONDS = 30  # after the drain: stop the engine process, flush logs
PROGRESS_MARGIN_SECONDS = 600


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
    """`--model`: a demo, the hub id, or the directory where the weights are mounted."""
    scheme, path = spec.model.source_scheme, spec.model.source_path
    if scheme == "demo":
        return path
    if scheme == "hf":
        return path
    if scheme == "pvc":
        _, _, sub = path.partition("/")
        return f"{MODEL_MOUNT}/{sub}".rstrip("/")
    return MODEL_MOUNT


@dataclass(frozen=True)
class PodContext:
    """What the engine and router pods of one service share, rendered once per service."""

    redis_url: str  # the `--redis` argument
    redis_env: list[dict[str, Any]]  # the variables `redis_url` refers to
    config_map: str  # name of the ConfigMap every pod reads with envFrom
    config_checksum: str  # sha256 of its data, a pod annotation: a change rolls the pods


def model_volumes(spec: InferenceServiceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts) that make the weights visible at `model_arg`."""
    scheme, path = spec.model.source_scheme, spec.model.source_path
    if scheme == "pvc":
        claim = path.partition("/")[0]
        source: dict[str, Any] = {"persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    elif scheme == "hostpath":
        source = {"hostPath": {"path": path, "type": "Directory"}}
    else:
        return [], []  # demos and hub models live in the cache
    return ([{"name": "model", **source}],
            [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}])


def cache_volumes(spec: InferenceServiceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The writable paths of an engine under a read-only root: /tmp, /cache, /dev/shm.

    /cache holds hub downloads (HF_HOME), compiled kernels and the demo checkpoint
    (KVFERRY_CACHE); an existing claim named in `spec.model.cache` replaces the hub part, so
    new pods find the weights already downloaded.
    """
    volumes = [
        empty_dir("tmp", TMP_SIZE_LIMIT),
        empty_dir("cache", spec.model.cache_size_limit),
        empty_dir("shm", spec.engine.shm_size, medium="Memory"),
    ]
    mounts = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": CACHE_MOUNT},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    if spec.model.cache_claim:
        claim = {"claimName": spec.model.cache_claim}
        volumes.append({"name": "hub-cache", "persistentVolumeClaim": claim})
        mounts.append({"name": "hub-cache", "mountPath": HUB_CACHE})
    return volumes, mounts


def cache_env() -> list[dict[str, Any]]:
    """Where the engine and the libraries it uses keep files: all under /cache.

    The image sets the same values (a container started without the operator writes where a
    pod does); the defaults would be under $HOME, on the read-only root filesystem.
    """
    return [
        {"name": "HF_HOME", "value": HUB_CACHE},
        {"name": "KVFERRY_CACHE", "value": f"{CACHE_MOUNT}/kvferry"},
        {"name": "XDG_CACHE_HOME", "value": CACHE_MOUNT},
        {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_MOUNT}/triton"},
        # The CUDA driver's cache of kernels compiled from PTX (a GPU newer than a library's
        # prebuilt code); unwritable, every process would compile them again.
        {"name": "CUDA_CACHE_PATH", "value": f"{CACHE_MOUNT}/cuda"},
        # torch.compile's cache defaults to /tmp, which is small and private to the pod.
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{CACHE_MOUNT}/torchinductor"},
    ]


def termination_grace_seconds(spec: InferenceServiceSpec) -> int:
    """Longer than the engine's drain, so the kubelet never kills a pod that is still draining."""
    return spec.engine.drain_seconds + SHUTDOWN_MARGIN_SECONDS


def _engine_container(spec: InferenceServiceSpec, pool: PoolSpec, ctx: PodContext) -> dict[str, Any]:
    _, model_mounts = model_volumes(spec)
    _, writable_mounts = cache_volumes(spec)
    container = {
        "name": "engine",
        "image": engine_image(spec, pool),
        "imagePullPolicy": spec.engine.image_pull_policy,
        "args": serve_args(spec, pool, ctx.redis_url),
        "ports": [
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "nixl", "containerPort": NIXL_PORT, "protocol": "TCP"},
        ],
        "env": [*ctx.redis_env, *cache_env(), {"name": "KVFERRY_ROLE", "value": pool.role},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                kv_transfer_key_env(spec)],
        "envFrom": [{"configMapRef": {"name": ctx.config_map}}],
        "volumeMounts": [*model_mounts, *writable_mounts],
        "securityContext": container_security_context(),
        **http_probes(spec.engine.startup_seconds),
    }
    resources = resources_manifest(pool.resources)
    return {**container, "resources": resources} if resources else container


def _anti_affinity(spec: InferenceServiceSpec, component: str) -> dict[str, Any]:
    """Prefer one pod of a pool per node (a node failure takes at most one replica)."""
    return {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100,
        "podAffinityTerm": {
            "labelSelector": {"matchLabels": selector_labels(spec.name, component)},
            "topologyKey": "kubernetes.io/hostname",
        },
    }]}}


def _engine_pod(spec: InferenceServiceSpec, pool: PoolSpec, ctx: PodContext) -> dict[str, Any]:
    model, _ = model_volumes(spec)
    writable, _ = cache_volumes(spec)
    pod: dict[str, Any] = {
        "securityContext": pod_security_context(RUN_AS_USER),
        "containers": [_engine_container(spec, pool, ctx)],
        "volumes": [*model, *writable],
        "affinity": _anti_affinity(spec, pool.name),
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
    }
    if pool.node_selector:
        pod["nodeSelector"] = dict(pool.node_selector)
    if pool.tolerations:
        pod["tolerations"] = [dict(t) for t in pool.tolerations]
    return apply_overrides(pod, pool.pod, spec.engine.image_pull_secrets)


def render_strategy(strategy: RolloutStrategy) -> dict[str, Any]:
    """A Deployment `strategy`; the default rolls one pod at a time with no surge pod."""
    if strategy.type == "Recreate":
        return {"type": "Recreate"}
    return {"type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": strategy.max_surge, "maxUnavailable": strategy.max_unavailable}}


def render_deployment(spec: InferenceServiceSpec, pool: PoolSpec, ctx: PodContext) -> dict[str, Any]:
    """The pool's Deployment; without `spec.replicas` when an HPA owns the count.

    Leaving `replicas` out of what the operator applies is what hands the field to the HPA
    under server-side apply (the operator stops owning it); `reconcile` makes sure the
    count is kept while that happens.
    """
    component = pool.name
    pod_labels = labels(spec.name, component)
    annotations = {**scrape_annotations(), CONFIG_CHECKSUM_ANNOTATION: ctx.config_checksum,
                   **kv_transfer_key_annotations(spec)}
    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(spec.name, component)},
        "strategy": render_strategy(pool.strategy),
        # The Deployment reports no progress while the model loads: allow the startup budget.
        "progressDeadlineSeconds": spec.engine.startup_seconds + PROGRESS_MARGIN_SECONDS,
        "template": {
            "metadata": pod_metadata(pod_labels, annotations, pool.pod),
            "spec": _engine_pod(spec, pool, ctx),
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


def render_pool(spec: InferenceServiceSpec, pool: PoolSpec, ctx: PodContext) -> list[dict[str, Any]]:
    """All children of one pool in apply order; the HPA, when the pool autoscales, comes first
    so that it exists before the Deployment stops carrying a replica count."""
    hpa = [render_hpa(spec, pool)] if pool.autoscaling is not None else []
    return [*hpa, render_deployment(spec, pool, ctx), render_headless_service(spec, pool),
            render_pdb(spec, pool)]
