"""The image and the pods the operator renders agree on where files are written.

Pods run with a read-only root filesystem; only their mounts are writable. Every cache
location is set by an environment variable, both in the image (for a container started
without the operator) and in the engine pods, with the same values, under those mounts.
"""

from __future__ import annotations

import os

import pytest
from kvferry_testing.image_files import DEMO_SERVICE, dockerfile_env, dockerfile_user
from kvferry_testing.image_pods import Pod, pods, rendered, under

# The writable volumes of an engine pod: scratch space, the cache, shared memory.
ENGINE_MOUNTS = {"/tmp", "/cache", "/dev/shm"}


def path_env(env: dict[str, str]) -> dict[str, str]:
    """The variables whose value is an absolute path: where something is read or written."""
    return {name: value for name, value in env.items() if os.path.isabs(value)}


@pytest.fixture(scope="module")
def demo_pods() -> dict[str, Pod]:
    return pods(rendered(DEMO_SERVICE))


def test_the_demo_service_has_engine_and_router_pods(demo_pods: dict[str, Pod]) -> None:
    assert sorted(demo_pods) == ["demo-decode", "demo-prefill", "demo-router"]


@pytest.mark.parametrize("name", ["demo-prefill", "demo-decode"])
def test_engine_pods_set_the_image_cache_locations(demo_pods: dict[str, Pod], name: str) -> None:
    pod = demo_pods[name]
    assert set(pod.writable_mounts()) == ENGINE_MOUNTS
    assert path_env(pod.literal_env()) == path_env(dockerfile_env())


def test_every_cache_location_is_under_an_engine_mount() -> None:
    outside = {k: v for k, v in path_env(dockerfile_env()).items()
               if not under(v, sorted(ENGINE_MOUNTS))}
    assert outside == {}
    # The kernels and the demo checkpoint, the hub, Triton's, CUDA's and torch.compile's
    # caches, and ~/.cache fallbacks.
    assert {"KVFERRY_CACHE", "HF_HOME", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH",
            "TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME"} <= set(path_env(dockerfile_env()))


def test_the_image_runs_as_the_pods_user(demo_pods: dict[str, Pod]) -> None:
    assert {pod.run_as_user for pod in demo_pods.values()} == {dockerfile_user()}
