"""Pod-template pieces every kvferry pod shares: security, probes, writable volumes, passthrough.

Every pod the operator renders meets the `restricted` Pod Security Standard (non-root,
no privilege escalation, all capabilities dropped, RuntimeDefault seccomp) and runs with a
read-only root filesystem; what must be writable is a size-limited emptyDir. What a spec
passes through (`env`, `volumes`, `affinity`, ...) is merged in last, keyed the way the API
server keys those lists, so a user entry replaces the operator's entry of the same key
instead of producing a duplicate that server-side apply would reject.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from kvferry.operator.spec import PodOverrides, Resources

CONFIG_CHECKSUM_ANNOTATION = "kvferry.dev/config-checksum"
"""Pod annotation: sha256 of the ConfigMap the pod reads, so a config change rolls the pods."""

TMP_SIZE_LIMIT = "1Gi"


def resources_manifest(resources: Resources) -> dict[str, Any]:
    """A container's `resources` (empty maps left out: the API server drops them)."""
    out: dict[str, Any] = {}
    if resources.requests:
        out["requests"] = dict(resources.requests)
    if resources.limits:
        out["limits"] = dict(resources.limits)
    return out


def pod_security_context(uid: int) -> dict[str, Any]:
    """Pod-level part of the `restricted` profile: a fixed non-root user and RuntimeDefault seccomp."""
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    """Container-level part of the `restricted` profile, plus a read-only root filesystem."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def empty_dir(name: str, size_limit: str, medium: str | None = None) -> dict[str, Any]:
    """A size-limited emptyDir volume (`size_limit` a canonical quantity)."""
    source: dict[str, Any] = {"sizeLimit": size_limit}
    if medium is not None:
        source = {"medium": medium, **source}
    return {"name": name, "emptyDir": source}


def http_probes(startup_seconds: int) -> dict[str, Any]:
    """Startup and readiness on `GET /health`, liveness on `GET /ping`.

    The startup probe allows `startup_seconds` for loading the model before liveness starts;
    liveness asks only whether the process answers (`/ping`), never whether the engine is
    ready, so a long engine step or a slow load never gets a pod restarted.
    """
    period = 10
    return {
        "startupProbe": {**_http_get("/health"), "periodSeconds": period,
                         "failureThreshold": max(1, math.ceil(startup_seconds / period))},
        "readinessProbe": {**_http_get("/health"), "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**_http_get("/ping"), "periodSeconds": 10, "failureThreshold": 6},
    }


def _http_get(path: str) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}}


def config_checksum(config_map: dict[str, Any]) -> str:
    """sha256 of a ConfigMap's data, stable across key order."""
    data = json.dumps(config_map.get("data", {}), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(data.encode()).hexdigest()


def merge_keyed(base: list[dict[str, Any]], extra: tuple[dict[str, Any], ...] | list[dict[str, Any]],
                key: str) -> list[dict[str, Any]]:
    """`base` with each `extra` item replacing the base item of the same `key`, new ones appended."""
    replaced = {item[key]: dict(item) for item in extra}
    merged = [replaced.pop(item[key], item) for item in base]
    return merged + [item for item in (dict(e) for e in extra) if item[key] in replaced]


def pod_metadata(labels: dict[str, str], annotations: dict[str, str],
                 pod: PodOverrides) -> dict[str, Any]:
    """Template metadata: the spec's labels and annotations under the operator's own."""
    out: dict[str, Any] = {"labels": {**pod.labels, **labels}}
    merged = {**pod.annotations, **annotations}
    if merged:
        out["annotations"] = merged
    return out


def apply_overrides(pod_spec: dict[str, Any], pod: PodOverrides,
                    image_pull_secrets: tuple[str, ...]) -> dict[str, Any]:
    """The pod spec with the passthrough fields merged into it and its first container.

    Lists are keyed like the API server keys them (env and volumes by name, mounts by
    path); empty lists are left out, as the API server drops them.
    """
    out = dict(pod_spec)
    container = dict(out["containers"][0])
    lists = [
        (container, "env", pod.env, "name"),
        (container, "envFrom", pod.env_from, None),
        (container, "volumeMounts", pod.volume_mounts, "mountPath"),
        (out, "volumes", pod.volumes, "name"),
    ]
    for target, field, extra, key in lists:
        base = target.get(field, [])
        merged = merge_keyed(base, extra, key) if key else [*base, *map(dict, extra)]
        _set_or_drop(target, field, merged)
    out["containers"] = [container, *out["containers"][1:]]
    if pod.affinity:
        out["affinity"] = {**out.get("affinity", {}), **pod.affinity}
    secrets = list(dict.fromkeys([*image_pull_secrets, *pod.image_pull_secrets]))
    _set_or_drop(out, "imagePullSecrets", [{"name": n} for n in secrets])
    for field, value in (("priorityClassName", pod.priority_class_name),
                         ("runtimeClassName", pod.runtime_class_name)):
        if value:
            out[field] = value
    return out


def _set_or_drop(target: dict[str, Any], field: str, value: list[Any]) -> None:
    if value:
        target[field] = value
    else:
        target.pop(field, None)
