#!/usr/bin/env bash
# The GPU check, run on the GPU machine from the repository root, with the wheels that
# scripts/device_wheels.sh put in .whl/ carried along, for example:
#
#   device run: bash scripts/device_check.sh    (carry: .whl; timeout 540 s)
#
# It installs those wheels and kvferry itself (no dependencies: the machine's torch and
# Triton stay) into a target folder, runs every test marked `gpu` and the GPU benchmarks,
# and writes their logs to $OUT (or ./device-check-out). One run ends within 10 minutes;
# KVFERRY_GPU_TESTS, KVFERRY_SKIP_KERNELS and the timeouts below fit it to a shorter lease.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-check-out}
SITE=${KVFERRY_DEVICE_SITE:-/tmp/kvferry-site}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

{
    nvidia-smi
    python3 -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, \
'triton', triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
} >"$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

rm -rf "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" . || exit 1
export PYTHONPATH="$SITE"
# Every import the server, its tests and the benchmarks need, before anything long runs: a
# package the wheels lack fails here in seconds (scripts/device_wheels.sh lists them).
python3 -P -c "import kvferry.engine.server.api_server, kvferry.engine.server.cli, openai, \
aiohttp, httpx, redis, zmq, msgspec; from fastapi.dependencies.utils import \
ensure_multipart_is_installed as check; check()" || exit 1

status=0
# The engine against HF generate and the memory floor first: its figures are what a short
# lease must bring back (KVFERRY_GPU_ENGINE_ARGS adds flags, for example --skip-server).
timeout "${KVFERRY_GPU_ENGINE_TIMEOUT:-240}" python3 -P benchmarks/gpu_engine.py \
    ${KVFERRY_GPU_ENGINE_ARGS:-} 2>&1 | tee "$OUT/gpu_engine.log" || status=1
# -P: the repository's own folders (kvferry/, operator/) must not shadow the installed package.
# Test files that mark gpu tests, and folders whose conftest marks them for every test there
# (KVFERRY_GPU_TESTS names a subset instead).
if [ -n "${KVFERRY_GPU_TESTS:-}" ]; then
    read -r -a GPU_TESTS <<<"$KVFERRY_GPU_TESTS"
else
    mapfile -t GPU_TESTS < <( (grep -rl --include='test_*.py' 'mark.gpu' tests;
        grep -rl --include='conftest.py' 'mark.gpu' tests | xargs -r -n1 dirname) | sort -u)
fi
timeout "${KVFERRY_GPU_TESTS_TIMEOUT:-240}" python3 -P -m pytest -m gpu -q -p no:cacheprovider \
    --durations=15 "${GPU_TESTS[@]}" 2>&1 | tee "$OUT/pytest_gpu.log" || status=1
if [ -z "${KVFERRY_SKIP_KERNELS:-}" ]; then
    timeout 100 python3 -P benchmarks/kernels.py 2>&1 | tee "$OUT/kernels.log" || status=1
fi
echo "device check: exit $status"
exit $status
