"""The kvferry operator: `InferenceService` objects in, pools of engine pods out.

`spec` parses and validates an InferenceService (no Kubernetes client needed, reused by
`kvferry up`); `render` turns a parsed spec into child manifests (pure functions);
`status` derives the observed state from the children; `reconcile` applies children
idempotently; `handlers` wires all of it into kopf. Nothing here imports torch.
"""

GROUP = "kvferry.dev"
VERSION = "v1alpha1"
PLURAL = "inferenceservices"
KIND = "InferenceService"
API_VERSION = f"{GROUP}/{VERSION}"
