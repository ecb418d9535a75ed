#!/usr/bin/env bash
# The whole path on a real cluster, where Docker and kind exist: build the image every pod
# runs, create a kind cluster and load the image into it, install the chart, apply the demo
# service, wait for Ready, send OpenAI requests through a port-forward, tear everything down
# (also on failure, after printing the pods' state and logs).
#   e2e/kind.sh            # KEEP=1 keeps the cluster for inspection
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER=${CLUSTER:-kvferry-e2e}
# The operator's default image for CPU pods (kvferry.operator.images.DEFAULT_IMAGE): the demo
# service's pods and the chart's operator run exactly what is built and loaded here, never a
# pulled one. tests/image/test_kind_script.py keeps the two equal.
IMAGE=ghcr.io/kvferry/kvferry:0.1.0
HELM=${HELM:-$( [ -x .cache/bin/helm ] && echo .cache/bin/helm || echo helm )}
PORT=${PORT:-18000}

for tool in docker kind kubectl "$HELM"; do
    command -v "$tool" >/dev/null || { echo "kind.sh needs $tool on PATH" >&2; exit 2; }
done

cleanup() {
    status=$?
    if [ -n "${FORWARD_PID:-}" ]; then kill "$FORWARD_PID" 2>/dev/null || true; fi
    if [ "$status" != 0 ] && [ -n "${CLUSTER_UP:-}" ]; then
        kubectl get inferenceservices,deployments,pods -A -o wide || true
        kubectl logs -n kvferry-system -l app.kubernetes.io/component=operator --tail=50 || true
        for deployment in demo-prefill demo-decode demo-router; do
            kubectl logs "deployment/$deployment" --tail=50 || true
        done
    fi
    if [ "${KEEP:-0}" != 1 ]; then kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

docker build -t "$IMAGE" .
kind create cluster --name "$CLUSTER" --wait 120s
CLUSTER_UP=1
kind load docker-image "$IMAGE" --name "$CLUSTER"

"$HELM" install kvferry charts/kvferry --namespace kvferry-system --create-namespace --wait --timeout 5m \
    --set operator.image.repository="${IMAGE%:*}" --set operator.image.tag="${IMAGE##*:}"
kubectl apply -f examples/demo.yaml
kubectl wait inferenceservice/demo --for=condition=Ready --timeout=15m
kubectl get inferenceservices

kubectl port-forward svc/demo-router "$PORT":8000 >/dev/null 2>&1 &
FORWARD_PID=$!
for _ in $(seq 30); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done

curl -sf "http://127.0.0.1:$PORT/v1/models" | grep -q '"demo"'
curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "demo", "prompt": "Hello", "max_tokens": 8}' | grep -q '"choices"'
python3 examples/client.py --url "http://127.0.0.1:$PORT" --model demo "Hello" >/dev/null

# Deleting the service takes its children with it (owner references).
kubectl delete -f examples/demo.yaml --wait --timeout=2m
kubectl wait deployment/demo-decode --for=delete --timeout=2m
echo "kind e2e passed"
