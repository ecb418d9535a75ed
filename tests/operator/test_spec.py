"""`parse_spec`: defaults, schema and CEL rules, on every example and on invalid CRs."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvferry.operator.schema import admit, cel_errors
from kvferry.operator.spec import SpecError, parse_spec
from kvferry_testing.operator_factories import EXAMPLES, load_example, minimal, service


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_are_admitted(path: Any) -> None:
    obj = load_example(path)
    _, errors = admit(obj)
    assert errors == []
    spec = parse_spec(obj)
    assert "decode" in spec.pools


def test_examples_cover_demo_gpu_autoscaling_and_encoder() -> None:
    specs = {p.stem: parse_spec(load_example(p)) for p in EXAMPLES}
    assert set(specs) == {"demo", "llama-gpu", "whisper", "whisper-service"}
    assert specs["demo"].model.source == "demo"
    assert specs["llama-gpu"].pools["decode"].autoscaling is not None
    assert specs["llama-gpu"].pools["decode"].resources.limits["nvidia.com/gpu"] == "1"
    assert specs["whisper"].pools["encoder"].role == "encoder"
    # The one `kvferry up` runs anywhere: a Whisper the pods generate, both pools.
    local = specs["whisper-service"]
    assert (local.model.source, local.model.type) == ("demo-whisper", "encoder-decoder")
    assert [(p.name, p.role) for p in local.pools.values()] == [("encoder", "encoder"),
                                                                ("decode", "decode")]
    assert local.pools["encoder"].autoscaling.metrics[0].name == \
        "kvferry:num_requests_waiting_for_encoder"  # type: ignore[union-attr]


def test_defaults_are_applied() -> None:
    spec = parse_spec(service(minimal(pools={"decode": {"autoscaling": {"maxReplicas": 4}}})))
    assert spec.name == spec.model.served_name == "svc"
    assert spec.namespace == "team-a"
    assert (spec.model.type, spec.model.dtype, spec.model.max_model_len) == ("decoder-only", "auto", None)
    assert spec.engine.image is None  # each pod gets the release's CPU or CUDA image
    assert (spec.engine.block_size, spec.engine.enable_prefix_caching) == (16, True)
    decode = spec.pools["decode"]
    assert (decode.role, decode.replicas) == ("both", 1)
    assert decode.autoscaling is not None
    assert (decode.autoscaling.min_replicas, decode.autoscaling.max_replicas) == (1, 4)
    assert [(m.name, m.target_average_value) for m in decode.autoscaling.metrics] == [
        ("vllm:num_requests_waiting", "4")]
    assert spec.router.replicas == 1 and spec.router.routing == {"decode": "least-loaded"}
    assert spec.redis.is_managed and spec.redis.image.endswith(":7.2.5-alpine")
    assert (spec.kv_transfer.lease_seconds, spec.kv_transfer.failure_policy) == (30, "recompute")


def test_each_pool_scales_on_its_own_queue_unless_told_otherwise() -> None:
    """The encoder pool's HPA watches requests waiting for their encoder, the others the
    engine's waiting queue; metrics given in the spec are kept as given."""
    scaling = {"autoscaling": {"maxReplicas": 4}}
    given = {"autoscaling": {"maxReplicas": 4, "metrics": [
        {"name": "vllm:num_requests_running", "targetAverageValue": "500m"}]}}
    spec = parse_spec(service(minimal(model={"source": "demo", "type": "encoder-decoder"},
                                      pools={"encoder": scaling, "prefill": scaling,
                                             "decode": given})))
    metrics = {name: [(m.name, m.target_average_value) for m in pool.autoscaling.metrics]
               for name, pool in spec.pools.items() if pool.autoscaling is not None}
    assert metrics == {"encoder": [("kvferry:num_requests_waiting_for_encoder", "4")],
                       "prefill": [("vllm:num_requests_waiting", "4")],
                       "decode": [("vllm:num_requests_running", "500m")]}
    # The CRD sets no default of its own (it would be one for every pool).
    defaulted, errors = admit(service(minimal(pools={"decode": scaling})))
    assert errors == [] and "metrics" not in defaulted["spec"]["pools"]["decode"]["autoscaling"]
    with pytest.raises(SpecError, match="metrics"):
        parse_spec(service(minimal(pools={"decode": {"autoscaling": {"maxReplicas": 4,
                                                                      "metrics": []}}})))


def test_roles_follow_the_pools() -> None:
    spec = parse_spec(service(minimal(pools={"prefill": {}, "decode": {}})))
    assert [(p.name, p.role) for p in spec.pools.values()] == [("prefill", "prefill"), ("decode", "decode")]
    assert spec.is_disaggregated
    assert spec.router.routing == {"prefill": "prefix-aware", "decode": "least-loaded"}
    encdec = {"source": "demo-whisper", "type": "encoder-decoder"}
    spec = parse_spec(service(minimal(model=encdec, pools={"encoder": {}, "decode": {}})))
    assert [(p.name, p.role) for p in spec.pools.values()] == [("encoder", "encoder"),
                                                                ("decode", "decode")]
    spec = parse_spec(service(minimal(model=encdec, pools={"decode": {}})))
    assert [(p.name, p.role) for p in spec.pools.values()] == [("decode", "both")]


def _with(path: str, value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(minimal())
    node = spec
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return spec


INVALID = [
    # (spec, a fragment of the expected error)
    ({"model": {"source": "demo"}, "pools": {}}, "'decode' is a required property"),
    ({"pools": {"decode": {}}}, "'model' is a required property"),
    (_with("model.source", "s3://bucket/model"), "spec.model.source"),
    (_with("model.dtype", "int4"), "spec.model.dtype"),
    (_with("engine.blockSize", 12), "spec.engine.blockSize"),
    (_with("engine.tensorParallelSize", 0), "spec.engine.tensorParallelSize"),
    (_with("engine.unknownField", True), "'unknownField' was unexpected"),
    (_with("pools.decode", {"replicas": -1}), "spec.pools.decode.replicas"),
    (_with("pools.decode", {"autoscaling": {"minReplicas": 1}}), "'maxReplicas' is a required property"),
    (_with("pools.decode", {"autoscaling": {"maxReplicas": 2, "metrics": []}}), "spec.pools.decode.autoscaling.metrics"),
    (_with("pools.decode", {"resources": {"limits": {"memory": "lots"}}}), "spec.pools.decode.resources.limits.memory"),
    (_with("redis", {"url": "http://not-redis"}), "spec.redis.url"),
    (_with("router", {"routing": {"decode": "random"}}), "spec.router.routing.decode"),
    (_with("kvTransfer.failurePolicy", "retry"), "spec.kvTransfer.failurePolicy"),
    (_with("kvTransfer.leaseSeconds", 0), "spec.kvTransfer.leaseSeconds"),
]

CEL_INVALID = [
    (_with("pools.decode", {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}),
     "spec.pools.decode.autoscaling.minReplicas: autoscaling.minReplicas must be <= autoscaling.maxReplicas"),
    (_with("pools.encoder", {}), "spec.pools.encoder: spec.pools.encoder runs the encoder of an "
     "encoder-decoder model (BART, Whisper), and spec.model.type is decoder-only: set "
     "spec.model.type: encoder-decoder, or drop the encoder pool"),
    (_with("redis", {"url": "redis://r:6379", "urlSecret": {"name": "s"}}), "spec.redis takes url or urlSecret, not both"),
    (_with("ingress", {"tls": {"secretName": "t"}}), "spec.ingress.tls: spec.ingress.tls needs spec.ingress.host"),
    (_with("router", {"routing": {"prefill": "prefix-aware"}}), "there is no spec.pools.prefill"),
    (_with("router", {"routing": {"encoder": "round-robin"}}), "there is no spec.pools.encoder"),
    (_with("model", {"source": "demo-whisper"}), "spec.model.type: demo-bart and demo-whisper "
     "are encoder-decoder models: set spec.model.type: encoder-decoder"),
    ({**_with("engine", {"tensorParallelSize": 2, "pipelineParallelSize": 2}),
      "pools": {"decode": {"resources": {"limits": {"nvidia.com/gpu": 2}}}}},
     "spec.pools.decode.resources: nvidia.com/gpu must be at least engine.tensorParallelSize x "
     "engine.pipelineParallelSize"),
    ({**_with("engine", {"tensorParallelSize": 4}),
      "pools": {"decode": {"resources": {"requests": {"nvidia.com/gpu": "2"}}}}},
     "spec.pools.decode.resources: nvidia.com/gpu must be at least"),
    ({**_with("engine", {"tensorParallelSize": 2}),
      "model": {"source": "demo-whisper", "type": "encoder-decoder"},
      "pools": {"decode": {"resources": {"limits": {"nvidia.com/gpu": 2}}}}},
     "spec.engine: engine.tensorParallelSize and engine.pipelineParallelSize above 1 run "
     "decoder-only models"),
    (_with("model.source", "hostpath:///"), "spec.model.source: hostpath:/// needs a normalized absolute path"),
    (_with("model.source", "hostpath:///mnt/../"), "spec.model.source: hostpath:/// needs"),
    (_with("model.source", "hostpath:////"), "spec.model.source: hostpath:/// needs"),
    (_with("model.source", "hostpath:///mnt//models"), "spec.model.source: hostpath:/// needs"),
    (_with("pools.decode", {"strategy": {"type": "Recreate", "maxSurge": 1}}),
     "maxSurge and strategy.maxUnavailable apply to RollingUpdate only"),
    (_with("pools.decode", {"strategy": {"maxUnavailable": 0}}),
     "spec.pools.decode.strategy.maxUnavailable: strategy.maxUnavailable 0 needs a maxSurge above 0"),
]


@pytest.mark.parametrize("spec", [
    {**_with("engine", {"tensorParallelSize": 2, "pipelineParallelSize": 2}),
     "pools": {"decode": {"resources": {"limits": {"nvidia.com/gpu": 4}, "requests": {"nvidia.com/gpu": "4"}}}}},
    # Parallel prefill and decode pods (their KV moves rank by rank).
    {**_with("engine", {"tensorParallelSize": 2}),
     "pools": {"decode": {"resources": {"limits": {"nvidia.com/gpu": 2}}},
               "prefill": {"resources": {"limits": {"nvidia.com/gpu": 2}}}}},
    _with("pools.decode", {"resources": {"limits": {"cpu": "1", "memory": "1Gi"}}}),
    _with("model.source", "hostpath:///mnt/models/llama-3.1.8b"),
    _with("pools.decode", {"strategy": {"maxUnavailable": 0, "maxSurge": "25%"}}),
], ids=["gpus-cover-tp-x-pp", "parallel-prefill-and-decode", "no-gpus", "hostpath-normalized",
        "surge-instead-of-unavailable"])
def test_cel_rules_admit(spec: dict[str, Any]) -> None:
    assert admit(service(spec))[1] == []


@pytest.mark.parametrize(("spec", "fragment"), INVALID)
def test_schema_rejects(spec: dict[str, Any], fragment: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(service(spec))
    assert any(fragment in e for e in caught.value.errors), caught.value.errors


@pytest.mark.parametrize(("spec", "fragment"), CEL_INVALID)
def test_cel_rules_reject(spec: dict[str, Any], fragment: str) -> None:
    defaulted, errors = admit(service(spec))
    assert errors and all(fragment in e for e in errors), errors
    with pytest.raises(SpecError, match="is invalid"):
        parse_spec(service(spec))


def test_cel_rule_on_the_name_limits_child_names() -> None:
    _, errors = admit(service(minimal(), name="a" * 53))
    assert errors == ["<root>: metadata.name must be a DNS-1035 label of at most 52 characters "
                      "(children add suffixes such as -redis-auth)"]
    _, errors = admit(service(minimal(), name="dotted.name"))
    assert len(errors) == 1
    assert cel_errors(service(minimal(), name="a" * 52)) == []


def test_wrong_kind_is_rejected() -> None:
    with pytest.raises(SpecError, match="apiVersion/kind"):
        parse_spec({**service(minimal()), "kind": "Deployment"})


def test_host_paths_names_every_hostpath_volume() -> None:
    volume = {"name": "scratch", "hostPath": {"path": "/mnt/scratch"}}
    spec = parse_spec(service(minimal(model={"source": "hostpath:///mnt/models/x"},
                                      pools={"decode": {"volumes": [{"name": "a", "emptyDir": {}}, volume]}},
                                      router={"volumes": [volume]})))
    assert spec.host_paths() == ["spec.model.source", "spec.pools.decode.volumes[1]", "spec.router.volumes[0]"]
    assert parse_spec(service(minimal())).host_paths() == []


def test_passed_through_quantities_are_canonical() -> None:
    volumes = [{"name": "tmp", "emptyDir": {"sizeLimit": "8192Mi"}}, {"name": "c", "configMap": {"name": "c"}}]
    spec = parse_spec(service(minimal(pools={"decode": {"volumes": volumes}},
                                      model={"source": "demo", "cache": {"sizeLimit": "0.5Ti"}},
                                      engine={"shmSize": 2**31})))
    assert spec.pools["decode"].pod.volumes == ({"name": "tmp", "emptyDir": {"sizeLimit": "8Gi"}}, volumes[1])
    # A plain integer is a decimal quantity: the API server never writes it in Gi.
    assert (spec.model.cache_size_limit, spec.engine.shm_size) == ("512Gi", "2147483648")
