"""The image each pod runs: `spec.engine.image`, else this release's CPU or CUDA image.

Both defaults are built from the one Dockerfile (its header has the commands): the CPU image
with a CPU build of torch, the CUDA image with a CUDA build of torch and Triton. A pool that
requests or limits `nvidia.com/gpu` gets the CUDA image; other pools and the router, which
never touches a GPU, get the smaller CPU image. An image named in the spec runs in every pod.
"""

from __future__ import annotations

from kvferry.operator.spec import InferenceServiceSpec, PoolSpec, Resources

from kvferry import __version__

IMAGE_REPOSITORY = "ghcr.io/kvferry/kvferry"
DEFAULT_IMAGE = f"{IMAGE_REPOSITORY}:{__version__}"
"""The CPU image of this release (the operator and its pods are one release)."""
DEFAULT_GPU_IMAGE = f"{DEFAULT_IMAGE}-cuda"
"""The CUDA image of this release, for pools that request GPUs."""
GPU_RESOURCE = "nvidia.com/gpu"


def requests_gpus(resources: Resources) -> bool:
    """True when a request or limit asks for at least one NVIDIA GPU."""
    return any(quantities.get(GPU_RESOURCE, "0") != "0"
               for quantities in (resources.requests, resources.limits))


def engine_image(spec: InferenceServiceSpec, pool: PoolSpec) -> str:
    """The image of one pool's pods."""
    if spec.engine.image is not None:
        return spec.engine.image
    return DEFAULT_GPU_IMAGE if requests_gpus(pool.resources) else DEFAULT_IMAGE


def router_image(spec: InferenceServiceSpec) -> str:
    """The image of the router's pods."""
    return spec.engine.image if spec.engine.image is not None else DEFAULT_IMAGE
