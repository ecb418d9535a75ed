"""The kvferry operator: `InferenceService` objects in, pools of engine pods out.

`spec` parses and validates an InferenceService (no Kubernetes client needed, reused by
`kvferry up`); `render` turns a parsed spec into child manifests (pure functions, in the
form the API server stores: see `quantity`); `children` decides which children to apply
or delete; `status` derives the observed state from the children; `reconcile` prunes and
server-side applies them; `handlers` wires all of it into kopf. Nothing here imports torch,
and the API emulator the operator is tested against is test tooling (e2e/).
"""

GROUP = "kvferry.dev"
VERSION = "v1alpha1"
PLURAL = "inferenceservices"
KIND = "InferenceService"
API_VERSION = f"{GROUP}/{VERSION}"
