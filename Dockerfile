# The one image every kvferry pod runs: engine (`kvferry serve`), router (`kvferry router`)
# and operator (`kvferry operator`). It installs the kvferry wheel with the `image` extra
# (`serve`, `kvtransfer`, `operator`), which the tests' set-up installs too; tests/image/
# builds the same environment in CI.
#
#   docker build -t ghcr.io/kvferry/kvferry:0.1.0 .
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#       -t ghcr.io/kvferry/kvferry:0.1.0-cuda .
#
# The first is the CPU image; the second, with a CUDA build of torch and Triton, is the one
# the operator gives the pools that request nvidia.com/gpu. CUDA 12 (cu12x) matches
# nixl-cu12, so the image holds one CUDA major version.
ARG PYTHON_IMAGE=python:3.11-slim

# The wheel, from the build context alone (.dockerignore keeps caches and environments out).
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --disable-pip-version-check --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Pods run with a read-only root filesystem: everything written at run time goes to /cache
# (compiled kernels, the demo checkpoint, hub downloads, Triton's, CUDA's and
# torch.compile's caches, any ~/.cache fallback) or /tmp. The operator sets the same
# variables in every engine pod (operator/render_pools.py, cache_env) and mounts both;
# tests/image/ checks that they agree and that a pod writes nowhere else.
ENV HF_HOME=/cache/huggingface \
    KVFERRY_CACHE=/cache/kvferry \
    XDG_CACHE_HOME=/cache \
    TRITON_CACHE_DIR=/cache/triton \
    CUDA_CACHE_PATH=/cache/cuda \
    TORCHINDUCTOR_CACHE_DIR=/cache/torchinductor

# A C compiler for the native CPU decode-attention kernel, built on first use (without
# one the engine falls back to plain torch on CPU).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first, from its own index and in a layer of its own, so a source change does not
# download it again; the project's `torch` requirement is then already met. A CUDA build
# brings Triton as its dependency; the check refuses a CUDA image without it.
RUN pip install --index-url "$TORCH_INDEX" torch \
    && python -c "import importlib.util, torch; \
assert torch.version.cuda is None or importlib.util.find_spec('triton'), 'CUDA torch without Triton'"

COPY --from=wheel /wheels /wheels
RUN pip install "$(ls /wheels/kvferry-*.whl)[image]" \
    && rm -rf /wheels \
    && useradd --uid 1000 --create-home --shell /usr/sbin/nologin kvferry \
    && mkdir -p /cache && chown kvferry /cache

USER 1000
EXPOSE 8000
ENTRYPOINT []
CMD ["kvferry", "--help"]
