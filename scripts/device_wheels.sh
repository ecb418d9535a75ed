#!/usr/bin/env bash
# Run on a developer machine (with PyPI): downloads into .whl/ (git-ignored) the wheels the
# GPU machine lacks, for its Python (CPython 3.12, x86-64 manylinux). That machine already
# has torch, triton, transformers, safetensors, tokenizers, numpy, pyyaml, pytest, httpx,
# aiohttp, anyio, h11, idna, jinja2, prometheus-client, uvloop and hypothesis; it reaches no
# package registry, so scripts/device_check.sh installs these from .whl/ there.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=.whl
# One version of each, with what each needs that the machine does not have.
WHEELS=(
    msgspec pyzmq
    fastapi starlette pydantic pydantic-core annotated-types typing-inspection
    uvicorn httptools
    openai distro jiter sniffio
    redis pytest-asyncio
    opentelemetry-api python-multipart
    httpx2 httpcore2 truststore
)

# The versions this machine runs the tests with, where it has them (a consistent set:
# pydantic pins its pydantic-core, for one), else the newest.
mapfile -t PINNED < <(python3 - "${WHEELS[@]}" <<'PY'
import importlib.metadata as metadata
import sys

for name in sys.argv[1:]:
    try:
        print(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(name)
PY
)

rm -rf "$DEST" && mkdir -p "$DEST"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any \
    -d "$DEST" "${PINNED[@]}"
ls "$DEST"
du -sh "$DEST"
