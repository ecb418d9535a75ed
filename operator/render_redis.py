"""Render the managed Redis of a service: password Secret, Deployment and Service.

Redis holds what pods must find about each other (NIXL metadata, pod registry, prefix
index); all of it is rebuilt by the pods on restart, so the managed Redis keeps no volume.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

from kvferry.operator.labels import REDIS_PORT, child_name, labels, selector_labels
from kvferry.operator.render_pod import (
    container_security_context,
    empty_dir,
    pod_security_context,
    resources_manifest,
)
from kvferry.operator.spec import InferenceServiceSpec

REDIS_UID = 999  # the redis user of the official image
DATA_SIZE_LIMIT = "256Mi"  # Redis's working directory; nothing is persisted (--save "")


def redis_password_secret(service: str) -> str:
    """Name of the Secret that holds the managed Redis password."""
    return child_name(service, "redis-auth")


def render_redis(spec: InferenceServiceSpec, password: str | None = None) -> list[dict[str, Any]]:
    """[password Secret, Deployment, Service] of the managed Redis.

    The Secret is created once and never patched, so a fresh random password at each render
    is harmless; pass `password` to make the output deterministic.
    """
    password = password if password is not None else secrets.token_urlsafe(24)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": redis_password_secret(spec.name), "labels": labels(spec.name, "redis")},
        "type": "Opaque",
        # `data`, not `stringData`: the API server stores only `data`.
        "data": {"password": base64.b64encode(password.encode()).decode()},
    }
    container: dict[str, Any] = {
        "name": "redis",
        "image": spec.redis.image,
        "imagePullPolicy": "IfNotPresent",
        # The shell expands the password from the environment, so it never shows in the spec.
        "command": ["sh", "-c", 'exec redis-server --save "" --appendonly no --requirepass "$REDIS_PASSWORD"'],
        "env": [{"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {
            "name": redis_password_secret(spec.name), "key": "password"}}}],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 15},
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        "securityContext": container_security_context(),
    }
    resources = resources_manifest(spec.redis.resources)
    if resources:
        container["resources"] = resources
    pod_labels = labels(spec.name, "redis")
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": child_name(spec.name, "redis"), "labels": pod_labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": selector_labels(spec.name, "redis")},
            "strategy": {"type": "Recreate"},
            "template": {"metadata": {"labels": pod_labels}, "spec": {
                "securityContext": pod_security_context(REDIS_UID),
                "containers": [container],
                "volumes": [empty_dir("data", DATA_SIZE_LIMIT)],
            }},
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": child_name(spec.name, "redis"), "labels": pod_labels},
        "spec": {
            "selector": selector_labels(spec.name, "redis"),
            "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}],
        },
    }
    return [secret, deployment, service]
