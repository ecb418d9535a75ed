"""The KV transfer key of a service: one generated Secret, shared by every engine pod.

Every pod of every pool reads the key from `KVFERRY_KV_TRANSFER_KEY` (a `secretKeyRef`);
with it, prefill pods sign the transfer params they return and decode pods act only on
signed ones (kvferry.kvtransfer.auth). The Secret is created once, owned by the service, and
never patched: a new key on every reconcile would break transfers between pods started
before and after it.

Rotation is on request: set (or change) the service's annotation
`rotation.kvferry.dev/kv-transfer-key` to any new value, e.g. a date. The operator then
replaces the Secret with a new key (it records the value it was made for) and the pods'
template carries the value too, so every pool rolls onto the new key. While a pool rolls,
transfers between a pod with the old key and one with the new fail their signature check
and the decode pod computes the prompt itself (policy `recompute`) or answers 400 (`fail`).
"""

from __future__ import annotations

import base64
from typing import Any

from kvferry.kvtransfer.auth import KEY_ENV, generate_key_text
from kvferry.operator.children import GENERATED_FOR_ANNOTATION
from kvferry.operator.labels import child_name, labels
from kvferry.operator.spec import KEY_ROTATION_ANNOTATION, InferenceServiceSpec

SECRET_KEY = "key"


def kv_transfer_key_secret(service: str) -> str:
    """Name of the Secret that holds the service's KV transfer key."""
    return child_name(service, "kv-transfer-key")


def render_kv_transfer_key(spec: InferenceServiceSpec, key: str | None = None) -> dict[str, Any]:
    """The key's Secret: a fresh random key unless `key` is given (tests).

    It records the rotation value it was made for, so the operator can tell when the
    service asks for a new one.
    """
    key = key if key is not None else generate_key_text()
    metadata: dict[str, Any] = {"name": kv_transfer_key_secret(spec.name),
                                "labels": labels(spec.name, "kv-transfer-key")}
    if spec.kv_transfer.key_rotation:
        # Left out while empty: the first key was made for no rotation.
        metadata["annotations"] = {GENERATED_FOR_ANNOTATION: spec.kv_transfer.key_rotation}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata,
        "type": "Opaque",
        # `data`, not `stringData`: the API server stores only `data`.
        "data": {SECRET_KEY: base64.b64encode(key.encode()).decode()},
    }


def kv_transfer_key_env(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The engine container's variable that carries the key."""
    return {"name": KEY_ENV, "valueFrom": {"secretKeyRef": {
        "name": kv_transfer_key_secret(spec.name), "key": SECRET_KEY}}}


def kv_transfer_key_annotations(spec: InferenceServiceSpec) -> dict[str, str]:
    """Engine pod annotations: the rotation value, so a rotation rolls the pods."""
    rotation = spec.kv_transfer.key_rotation
    return {KEY_ROTATION_ANNOTATION: rotation} if rotation else {}
