"""The image each pod runs: the CUDA image in pools that request GPUs, unless the spec names one."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml
from kvferry.operator.images import DEFAULT_GPU_IMAGE, DEFAULT_IMAGE
from kvferry.operator.render import render_children
from kvferry.operator.spec import parse_spec
from kvferry_testing.chart import CHART
from kvferry_testing.operator_factories import EXAMPLES, load_example, minimal, service

import kvferry

K8S_VERSION = "1.30"
GPU_POOL = {"replicas": 1, "resources": {"limits": {"nvidia.com/gpu": 2}}}
GPU_REQUEST_POOL = {"replicas": 1, "resources": {"requests": {"nvidia.com/gpu": "1", "cpu": "4"}}}
CPU_POOL = {"replicas": 1, "resources": {"requests": {"cpu": "2"}, "limits": {"memory": "8Gi"}}}


def images(obj: dict[str, Any]) -> dict[str, str]:
    """Deployment name -> the image of its first container, every child schema-checked."""
    out = {}
    for child in render_children(parse_spec(obj)):
        kubernetes_validate.validate(child.manifest, K8S_VERSION, strict=True)
        if child.kind == "Deployment":
            out[child.name] = child.manifest["spec"]["template"]["spec"]["containers"][0]["image"]
    return {name: image for name, image in out.items() if not name.endswith("-redis")}


def test_the_default_images_are_this_release() -> None:
    assert DEFAULT_IMAGE == f"ghcr.io/kvferry/kvferry:{kvferry.__version__}"
    assert DEFAULT_GPU_IMAGE == f"{DEFAULT_IMAGE}-cuda"
    # The chart's operator runs the same release as the pods it creates.
    values = yaml.safe_load((CHART / "values.yaml").read_text())["operator"]["image"]
    assert f"{values['repository']}:{values['tag']}" == DEFAULT_IMAGE
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"] == kvferry.__version__


def test_cpu_pools_and_the_router_run_the_cpu_image() -> None:
    demo = next(p for p in EXAMPLES if p.stem == "demo")
    assert images(load_example(demo)) == {
        "demo-prefill": DEFAULT_IMAGE, "demo-decode": DEFAULT_IMAGE, "demo-router": DEFAULT_IMAGE}


def test_pools_that_request_gpus_run_the_cuda_image() -> None:
    obj = service(minimal(pools={"prefill": GPU_REQUEST_POOL, "decode": GPU_POOL}))
    assert images(obj) == {"svc-prefill": DEFAULT_GPU_IMAGE, "svc-decode": DEFAULT_GPU_IMAGE,
                           "svc-router": DEFAULT_IMAGE}


def test_a_cpu_pool_beside_a_gpu_pool_keeps_the_cpu_image() -> None:
    obj = service(minimal(pools={"prefill": CPU_POOL, "decode": GPU_POOL}))
    assert images(obj)["svc-prefill"] == DEFAULT_IMAGE
    assert images(obj)["svc-decode"] == DEFAULT_GPU_IMAGE


@pytest.mark.parametrize("name", ["llama-gpu", "whisper"])
def test_gpu_examples_run_the_cuda_image(name: str) -> None:
    rendered = images(load_example(next(p for p in EXAMPLES if p.stem == name)))
    engines = {k: v for k, v in rendered.items() if not k.endswith("-router")}
    assert set(engines.values()) == {DEFAULT_GPU_IMAGE}
    assert [v for k, v in rendered.items() if k.endswith("-router")] == [DEFAULT_IMAGE]


def test_an_image_the_spec_names_runs_in_every_pod() -> None:
    obj = service(minimal(engine={"image": "registry.example/kvferry:custom"},
                          pools={"prefill": CPU_POOL, "decode": GPU_POOL}))
    assert set(images(obj).values()) == {"registry.example/kvferry:custom"}
