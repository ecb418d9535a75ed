#!/usr/bin/env bash
# The GPU check, run on the GPU machine from the repository root, with the wheels that
# scripts/device_wheels.sh put in .whl/ carried along, for example:
#
#   device run: bash scripts/device_check.sh    (carry: .whl; timeout 600 s)
#
# On an H100 the benchmarks take about 5 minutes and the GPU tests about 5 more (2026-11-27):
# on a lease of 15 minutes run them as two calls, KVFERRY_SKIP_TESTS=1 then
# KVFERRY_SKIP_KERNELS=1 KVFERRY_SKIP_ENGINE=1.
#
# It installs those wheels and kvferry itself (no dependencies: the machine's torch and
# Triton stay) into a target folder, runs every test marked `gpu` and the GPU benchmarks,
# and writes their logs to $OUT (or ./device-check-out). One run ends within about 10 minutes
# (KVFERRY_DEVICE_CHECK_SECONDS, 560 by default, bounds the phases; the tests get what is
# left); KVFERRY_TUNE (measure the attention table first), KVFERRY_GPU_TESTS,
# KVFERRY_SKIP_KERNELS, KVFERRY_SKIP_ENGINE, KVFERRY_SKIP_TESTS and the timeouts below fit it
# to a shorter lease.
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
# Whole-run deadline: the phases below share it, the tests take what is left.
DEADLINE=$((SECONDS + ${KVFERRY_DEVICE_CHECK_SECONDS:-560}))
# With KVFERRY_TUNE set, the attention kernel's launch shapes are measured on this GPU first
# and every later phase uses the table it writes (KVFERRY_ATTENTION_TUNING): the figures and
# tests below are then those of the tuned kernel. Without it they check the built-in table,
# what the engine runs by default.
if [ -n "${KVFERRY_TUNE:-}" ]; then
    timeout "${KVFERRY_TUNING_TIMEOUT:-150}" python3 -P benchmarks/attention_tuning.py \
        --out "$OUT/attention_tuning.json" --budget-s "${KVFERRY_TUNING_BUDGET:-100}" 2>&1 \
        | tee "$OUT/attention_tuning.log" || status=1
    if [ -s "$OUT/attention_tuning.json" ]; then
        export KVFERRY_ATTENTION_TUNING="$OUT/attention_tuning.json"
    fi
fi
if [ -z "${KVFERRY_SKIP_KERNELS:-}" ]; then
    timeout 80 python3 -P benchmarks/kernels.py 2>&1 | tee "$OUT/kernels.log" || status=1
fi
# The engine against HF generate and the memory floor (KVFERRY_GPU_ENGINE_ARGS adds flags,
# for example --skip-server; KVFERRY_SKIP_ENGINE leaves it out).
if [ -z "${KVFERRY_SKIP_ENGINE:-}" ]; then
    timeout "${KVFERRY_GPU_ENGINE_TIMEOUT:-260}" python3 -P benchmarks/gpu_engine.py \
        ${KVFERRY_GPU_ENGINE_ARGS:---async-scheduling} 2>&1 | tee "$OUT/gpu_engine.log" \
        || status=1
fi
# -P: the repository's own folders (kvferry/, operator/) must not shadow the installed package.
# Test files that mark gpu tests, and folders whose conftest marks them for every test there
# (KVFERRY_GPU_TESTS names a subset instead); the kernels' folder first.
if [ -n "${KVFERRY_GPU_TESTS:-}" ]; then
    read -r -a GPU_TESTS <<<"$KVFERRY_GPU_TESTS"
else
    mapfile -t GPU_TESTS < <( (grep -rl --include='test_*.py' 'mark.gpu' tests;
        grep -rl --include='conftest.py' 'mark.gpu' tests | xargs -r -n1 dirname) \
        | sort -u | sort -t/ -k3,3 -s | awk '/attention/ {print; next} {rest = rest $0 "\n"}
        END {printf "%s", rest}')
fi
LEFT=$((DEADLINE - SECONDS))
if [ "$LEFT" -lt 30 ]; then LEFT=30; fi
if [ -z "${KVFERRY_SKIP_TESTS:-}" ]; then
    timeout "${KVFERRY_GPU_TESTS_TIMEOUT:-$LEFT}" python3 -P -m pytest -m gpu -v \
        -p no:cacheprovider --durations=15 "${GPU_TESTS[@]}" >"$OUT/pytest_gpu.log" 2>&1 \
        || status=1
    grep -E "PASSED|FAILED|ERROR|SKIPPED" "$OUT/pytest_gpu.log" | awk '{print $2}' | sort \
        | uniq -c
    grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed)" "$OUT/pytest_gpu.log" | tail -15
fi
echo "device check: exit $status"
exit $status
