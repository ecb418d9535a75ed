# The one image every kvferry pod runs: engine (`kvferry serve`), router (`kvferry router`)
# and operator (`kvferry operator`). CPU torch by default; pass
# --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 for a CUDA build.
FROM python:3.11-slim AS base

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/cache

# A C compiler for the native CPU decode-attention kernel, built on first use (without
# one the engine falls back to plain torch on CPU).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV KVFERRY_CACHE=/cache/kvferry

WORKDIR /opt/kvferry
# Dependencies first, so source edits do not re-download torch.
COPY pyproject.toml setup.py ./
RUN pip install --index-url "$TORCH_INDEX" torch \
    && pip install "kopf>=1.37" "cel-python>=0.2" "jsonschema>=4.18" "pyyaml>=6.0"
COPY . .
# The CRD ships inside the package (kvferry.operator's crds/ links to the top-level one).
RUN pip install '.[operator]' \
    && useradd --uid 1000 --create-home --shell /usr/sbin/nologin kvferry \
    && mkdir -p /cache && chown kvferry /cache

USER 1000
EXPOSE 8000
ENTRYPOINT []
CMD ["kvferry", "--help"]
