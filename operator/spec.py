"""`parse_spec`: an InferenceService manifest in, a typed, defaulted, validated spec out.

The one parser of the project: the operator reconciles what it returns and `kvferry up`
runs it locally. It applies the CRD's defaults and checks its schema and CEL rules, so a
spec accepted here is one the API server accepts too. No Kubernetes client, no kopf.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvferry.operator import API_VERSION, KIND
from kvferry.operator.quantity import QuantityError, canonical_quantity
from kvferry.operator.schema import admit

POOL_NAMES = ("encoder", "prefill", "decode")
# The model sources the pods generate themselves (kvferry.engine.models.source).
DEMO_SOURCES = ("demo", "demo-bart", "demo-whisper")
# InferenceService annotation: a new value asks for a new KV transfer key. Not under
# `kvferry.dev/`: kopf keeps its own state there and ignores changes to those annotations.
KEY_ROTATION_ANNOTATION = "rotation.kvferry.dev/kv-transfer-key"
"""Pools in request order: encoder -> prefill -> decode."""

DEFAULT_ROUTING = {"encoder": "least-loaded", "prefill": "prefix-aware", "decode": "least-loaded"}
"""Routing policy of a pool whose `spec.router.routing.<pool>` is unset."""

DEFAULT_METRICS = {
    "encoder": ({"name": "kvferry:num_requests_waiting_for_encoder", "targetAverageValue": 4},),
    "prefill": ({"name": "vllm:num_requests_waiting", "targetAverageValue": 4},),
    "decode": ({"name": "vllm:num_requests_waiting", "targetAverageValue": 4},),
}
"""What a pool's HPA scales on when its `autoscaling.metrics` is unset: the pool's queue
(the CRD sets no default, which would be one for every pool: an encoder pod's queue is of
requests whose encoder has yet to run)."""


class SpecError(ValueError):
    """An InferenceService that the CRD's schema or rules reject; `errors` names each field."""

    def __init__(self, name: str, errors: list[str]) -> None:
        self.errors = errors
        super().__init__(f"InferenceService {name!r} is invalid: " + "; ".join(errors))


@dataclass(frozen=True)
class ModelSpec:
    served_name: str  # the `model` clients send; the service name unless set
    source: str  # demo | demo-bart | demo-whisper | hf://ORG/NAME | pvc://CLAIM/PATH | hostpath:///PATH
    type: str  # decoder-only | encoder-decoder
    dtype: str  # auto | float16 | bfloat16 | float32
    max_model_len: int | None  # None: the checkpoint's own
    cache_claim: str | None  # an existing PVC mounted as the hub cache, shared by the pods
    cache_size_limit: str  # canonical quantity: size limit of the pod-local /cache

    @property
    def source_scheme(self) -> str:
        """`demo` (any of the demos), `hf`, `pvc` or `hostpath`."""
        return "demo" if self.source in DEMO_SOURCES else self.source.split("://", 1)[0]

    @property
    def source_path(self) -> str:
        """What follows the scheme: hub id, CLAIM/PATH, or the absolute host path; a demo's
        name (`demo`, `demo-bart`, `demo-whisper`)."""
        return self.source if self.source in DEMO_SOURCES else self.source.split("://", 1)[1]


@dataclass(frozen=True)
class EngineSpec:
    image: str | None  # None: this release's CPU or CUDA image, per pool (operator/images.py)
    image_pull_policy: str
    image_pull_secrets: tuple[str, ...]  # Secret names in the service's namespace
    block_size: int  # tokens per KV block
    enable_prefix_caching: bool
    enable_prompt_embeds: bool
    tensor_parallel_size: int
    pipeline_parallel_size: int
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    extra_args: tuple[str, ...]  # appended verbatim to `kvferry serve`
    drain_seconds: int  # a stopping engine finishes running requests this long (KVFERRY_DRAIN_SECONDS)
    startup_seconds: int  # budget of the startup probe: model download and load
    shm_size: str  # canonical quantity: size of the in-memory /dev/shm


@dataclass(frozen=True)
class Resources:
    requests: dict[str, str] = field(default_factory=dict)  # e.g. {"cpu": "2"}
    limits: dict[str, str] = field(default_factory=dict)  # e.g. {"nvidia.com/gpu": "1"}


@dataclass(frozen=True)
class MetricTarget:
    name: str  # a per-pod metric served by prometheus-adapter, e.g. vllm:num_requests_waiting
    target_average_value: str  # a quantity: the HPA keeps the per-pod average near it


@dataclass(frozen=True)
class Autoscaling:
    min_replicas: int
    max_replicas: int
    metrics: tuple[MetricTarget, ...]


@dataclass(frozen=True)
class PodOverrides:
    """What a pool's or the router's spec passes through into its pod template, as given."""

    labels: dict[str, str] = field(default_factory=dict)  # extra pod labels
    annotations: dict[str, str] = field(default_factory=dict)  # extra pod annotations
    env: tuple[dict[str, Any], ...] = ()  # EnvVar objects; replace the operator's by name
    env_from: tuple[dict[str, Any], ...] = ()  # EnvFromSource objects
    affinity: dict[str, Any] = field(default_factory=dict)  # replaces the operator's per key
    priority_class_name: str | None = None
    runtime_class_name: str | None = None
    volumes: tuple[dict[str, Any], ...] = ()  # Volume objects; replace the operator's by name
    volume_mounts: tuple[dict[str, Any], ...] = ()  # replace the operator's by mountPath
    image_pull_secrets: tuple[str, ...] = ()  # Secret names, after spec.engine.imagePullSecrets


@dataclass(frozen=True)
class RolloutStrategy:
    type: str  # RollingUpdate | Recreate
    max_surge: int | str | None  # RollingUpdate only; 0 by default, so no spare GPU is needed
    max_unavailable: int | str | None  # RollingUpdate only; 1 by default


@dataclass(frozen=True)
class PoolSpec:
    name: str  # encoder | prefill | decode
    role: str  # the `kvferry serve --role` of its pods
    replicas: int  # ignored while `autoscaling` is set
    resources: Resources
    node_selector: dict[str, str]
    tolerations: tuple[dict[str, Any], ...]  # Kubernetes Toleration objects, as given
    autoscaling: Autoscaling | None
    strategy: RolloutStrategy
    pod: PodOverrides


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class RouterSpec:
    replicas: int
    resources: Resources
    routing: dict[str, str]  # pool name -> policy, for the pools that exist
    api_key_secret: SecretKeyRef | None
    pod: PodOverrides
    # The prefill hop is skipped for fewer uncached prompt tokens than this.
    prefill_threshold_tokens: int = 256


@dataclass(frozen=True)
class IngressSpec:
    host: str | None
    class_name: str | None
    tls_secret_name: str | None
    annotations: dict[str, str]


@dataclass(frozen=True)
class RedisSpec:
    url: str | None  # an external Redis by URL
    url_secret: SecretKeyRef | None  # an external Redis whose URL is in a Secret
    image: str  # image of the managed Redis
    resources: Resources

    @property
    def is_managed(self) -> bool:
        """True when the operator runs a Redis for this service."""
        return self.url is None and self.url_secret is None


@dataclass(frozen=True)
class KVTransferSpec:
    lease_seconds: int  # a prefill pod frees unpulled blocks after this long
    failure_policy: str  # recompute | fail
    # The service's `rotation.kvferry.dev/kv-transfer-key` annotation ("" when unset): a new
    # value asks for a new KV transfer key (operator/render_kv_key.py).
    key_rotation: str = ""


@dataclass(frozen=True)
class NetworkPolicySpec:
    enabled: bool
    # The NetworkPolicyPeer Prometheus scrapes from (namespaceSelector and/or podSelector);
    # None: no pod outside the service reaches the engines.
    metrics_peer: dict[str, Any] | None


@dataclass(frozen=True)
class InferenceServiceSpec:
    """A parsed InferenceService: every default applied, every rule checked."""

    name: str
    namespace: str
    model: ModelSpec
    engine: EngineSpec
    pools: dict[str, PoolSpec]  # only the pools that exist, in POOL_NAMES order
    router: RouterSpec
    ingress: IngressSpec | None
    redis: RedisSpec
    kv_transfer: KVTransferSpec
    network_policy: NetworkPolicySpec

    @property
    def is_disaggregated(self) -> bool:
        """True when prefill and decode run in separate pools."""
        return "prefill" in self.pools

    def host_paths(self) -> list[str]:
        """Fields that mount a node directory (hostPath), for the operator's hostPath policy."""
        found = ["spec.model.source"] if self.model.source_scheme == "hostpath" else []
        owners = [(f"spec.pools.{p.name}", p.pod) for p in self.pools.values()]
        for where, pod in [*owners, ("spec.router", self.router.pod)]:
            found += [f"{where}.volumes[{i}]" for i, v in enumerate(pod.volumes) if "hostPath" in v]
        return found


def parse_spec(obj: dict[str, Any], default_namespace: str = "default") -> InferenceServiceSpec:
    """Parse an InferenceService manifest (a dict, as from YAML or the API server).

    Applies the CRD's defaults, validates against its openAPIV3Schema and CEL rules, and
    returns typed dataclasses. Raises `SpecError` listing every broken field.
    """
    obj = {"apiVersion": API_VERSION, "kind": KIND, **obj}
    name = str(obj.get("metadata", {}).get("name", "<unnamed>"))
    if obj["apiVersion"] != API_VERSION or obj["kind"] != KIND:
        raise SpecError(name, [f"apiVersion/kind: expected {API_VERSION} {KIND}"])
    defaulted, errors = admit(obj)
    if errors:
        raise SpecError(name, errors)
    try:
        return _build(name, defaulted, default_namespace)
    except QuantityError as exc:  # a quantity the schema's pattern lets through, e.g. 1e1.5
        raise SpecError(name, [str(exc)]) from exc


def _build(name: str, defaulted: dict[str, Any], default_namespace: str) -> InferenceServiceSpec:
    spec = defaulted["spec"]
    namespace = defaulted["metadata"].get("namespace") or default_namespace
    pools = {p: _pool(p, spec["pools"][p], spec) for p in POOL_NAMES if p in spec["pools"]}
    return InferenceServiceSpec(
        name=name,
        namespace=namespace,
        model=_model(spec["model"], name),
        engine=_engine(spec["engine"]),
        pools=pools,
        router=_router(spec["router"], pools),
        ingress=_ingress(spec["ingress"]) if "ingress" in spec else None,
        redis=_redis(spec["redis"]),
        kv_transfer=KVTransferSpec(
            lease_seconds=spec["kvTransfer"]["leaseSeconds"],
            failure_policy=spec["kvTransfer"]["failurePolicy"],
            key_rotation=str((defaulted["metadata"].get("annotations") or {})
                             .get(KEY_ROTATION_ANNOTATION, "")),
        ),
        network_policy=NetworkPolicySpec(
            enabled=spec["networkPolicy"]["enabled"],
            metrics_peer=spec["networkPolicy"].get("metrics"),
        ),
    )


def _model(m: dict[str, Any], name: str) -> ModelSpec:
    return ModelSpec(
        served_name=m.get("name") or name,
        source=m["source"],
        type=m["type"],
        dtype=m["dtype"],
        max_model_len=m.get("maxModelLen"),
        cache_claim=m["cache"].get("claimName"),
        cache_size_limit=canonical_quantity(m["cache"]["sizeLimit"]),
    )


def _engine(e: dict[str, Any]) -> EngineSpec:
    return EngineSpec(
        image=e.get("image"),
        image_pull_policy=e["imagePullPolicy"],
        image_pull_secrets=tuple(e.get("imagePullSecrets", ())),
        block_size=e["blockSize"],
        enable_prefix_caching=e["enablePrefixCaching"],
        enable_prompt_embeds=e["enablePromptEmbeds"],
        tensor_parallel_size=e["tensorParallelSize"],
        pipeline_parallel_size=e["pipelineParallelSize"],
        max_num_seqs=e.get("maxNumSeqs"),
        max_num_batched_tokens=e.get("maxNumBatchedTokens"),
        extra_args=tuple(e.get("extraArgs", ())),
        drain_seconds=e["drainSeconds"],
        startup_seconds=e["startupSeconds"],
        shm_size=canonical_quantity(e["shmSize"]),
    )


def _resources(r: dict[str, Any] | None) -> Resources:
    r = r or {}
    return Resources(
        requests={k: canonical_quantity(v) for k, v in r.get("requests", {}).items()},
        limits={k: canonical_quantity(v) for k, v in r.get("limits", {}).items()},
    )


def _pod_overrides(p: dict[str, Any]) -> PodOverrides:
    return PodOverrides(
        labels=dict(p.get("podLabels", {})),
        annotations=dict(p.get("podAnnotations", {})),
        env=tuple(p.get("env", ())),
        env_from=tuple(p.get("envFrom", ())),
        affinity=dict(p.get("affinity", {})),
        priority_class_name=p.get("priorityClassName"),
        runtime_class_name=p.get("runtimeClassName"),
        volumes=tuple(_canonical_volume(v) for v in p.get("volumes", ())),
        volume_mounts=tuple(p.get("volumeMounts", ())),
        image_pull_secrets=tuple(p.get("imagePullSecrets", ())),
    )


def _canonical_volume(volume: dict[str, Any]) -> dict[str, Any]:
    # The API server rewrites an emptyDir's sizeLimit in canonical form (8192Mi -> 8Gi);
    # passing it through as written would make the pod template differ on every read.
    empty_dir = volume.get("emptyDir")
    if not isinstance(empty_dir, dict) or "sizeLimit" not in empty_dir:
        return dict(volume)
    return {**volume, "emptyDir": {**empty_dir, "sizeLimit": canonical_quantity(empty_dir["sizeLimit"])}}


def _strategy(s: dict[str, Any]) -> RolloutStrategy:
    if s["type"] == "Recreate":
        return RolloutStrategy("Recreate", None, None)
    return RolloutStrategy("RollingUpdate", s.get("maxSurge", 0), s.get("maxUnavailable", 1))


def _role(pool: str, spec: dict[str, Any]) -> str:
    """A pool's `--role`: its name, but for a decode pool that computes prompts itself (no
    prefill nor encoder pool hands it KV), which runs `both`."""
    if pool == "decode" and not {"prefill", "encoder"} & set(spec["pools"]):
        return "both"
    return pool


def _pool(pool: str, p: dict[str, Any], spec: dict[str, Any]) -> PoolSpec:
    scaling = p.get("autoscaling")
    return PoolSpec(
        name=pool,
        role=_role(pool, spec),
        replicas=p["replicas"],
        resources=_resources(p.get("resources")),
        node_selector=dict(p.get("nodeSelector", {})),
        tolerations=tuple(dict(t) for t in p.get("tolerations", ())),
        autoscaling=None if scaling is None else Autoscaling(
            min_replicas=scaling["minReplicas"],
            max_replicas=scaling["maxReplicas"],
            metrics=tuple(
                MetricTarget(m["name"], canonical_quantity(m["targetAverageValue"]))
                for m in scaling.get("metrics") or DEFAULT_METRICS[pool]
            ),
        ),
        strategy=_strategy(p["strategy"]),
        pod=_pod_overrides(p),
    )


def _secret_ref(ref: dict[str, Any] | None) -> SecretKeyRef | None:
    return None if ref is None else SecretKeyRef(name=ref["name"], key=ref["key"])


def _router(r: dict[str, Any], pools: dict[str, PoolSpec]) -> RouterSpec:
    routing = {p: r["routing"].get(p, DEFAULT_ROUTING[p]) for p in pools}
    return RouterSpec(
        replicas=r["replicas"],
        resources=_resources(r.get("resources")),
        routing=routing,
        api_key_secret=_secret_ref(r.get("apiKeySecret")),
        pod=_pod_overrides(r),
        prefill_threshold_tokens=r.get("prefillThresholdTokens", 256),
    )


def _ingress(i: dict[str, Any]) -> IngressSpec:
    return IngressSpec(
        host=i.get("host"),
        class_name=i.get("className"),
        tls_secret_name=i.get("tls", {}).get("secretName"),
        annotations=dict(i.get("annotations", {})),
    )


def _redis(r: dict[str, Any]) -> RedisSpec:
    return RedisSpec(
        url=r.get("url"),
        url_secret=_secret_ref(r.get("urlSecret")),
        image=r["image"],
        resources=_resources(r.get("resources")),
    )
