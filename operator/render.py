"""Render the children of an InferenceService: pure functions from a parsed spec to manifests.

`render_children(spec)` is the entry point; each child is a plain dict that
`kubernetes-validate` accepts. Owner references are added where the children are applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvferry.operator.labels import NIXL_PORT, REDIS_PORT, child_name, labels
from kvferry.operator.render_kv_key import render_kv_transfer_key
from kvferry.operator.render_network import render_network_policies
from kvferry.operator.render_pod import config_checksum
from kvferry.operator.render_pools import PodContext, render_pool
from kvferry.operator.render_redis import redis_password_secret, render_redis
from kvferry.operator.render_router import render_ingress, render_router
from kvferry.operator.spec import InferenceServiceSpec
from kvferry.protocol.registry import REDIS_URL_ENV


@dataclass(frozen=True)
class Child:
    """One object the operator keeps in place for an InferenceService."""

    manifest: dict[str, Any]  # the desired object (apiVersion, kind, metadata.name, ...)
    # Created when missing, never patched (generated Secrets); replaced when generated for
    # another rotation (children.GENERATED_FOR_ANNOTATION).
    create_only: bool = False

    @property
    def kind(self) -> str:
        return str(self.manifest["kind"])

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])


def config_map_name(spec: InferenceServiceSpec) -> str:
    """Name of the ConfigMap holding the engine settings that have no command-line flag."""
    return child_name(spec.name, "config")


def render_config_map(spec: InferenceServiceSpec) -> dict[str, Any]:
    """Engine and router settings without a command-line flag, as environment variables."""
    data = {
        "KVFERRY_SERVICE": spec.name,
        "KVFERRY_MODEL_TYPE": spec.model.type,
        "KVFERRY_NIXL_PORT": str(NIXL_PORT),
        "KVFERRY_KV_LEASE_SECONDS": str(spec.kv_transfer.lease_seconds),
        "KVFERRY_KV_FAILURE_POLICY": spec.kv_transfer.failure_policy,
        "KVFERRY_DRAIN_SECONDS": str(spec.engine.drain_seconds),
        "KVFERRY_PREFILL_THRESHOLD": str(spec.router.prefill_threshold_tokens),
    }
    for pool, policy in spec.router.routing.items():
        data[f"KVFERRY_ROUTING_{pool.upper()}"] = policy
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": config_map_name(spec), "labels": labels(spec.name, "config")},
        "data": data,
    }


def redis_url(spec: InferenceServiceSpec) -> str:
    """The `--redis` argument: an env-var reference the kubelet expands, or the given URL.

    Pods get `KVFERRY_REDIS_URL` (external Secret) or `REDIS_PASSWORD` (managed Redis) from
    `redis_env`; `$(VAR)` in container args is expanded by Kubernetes, never by a shell.
    """
    if spec.redis.url_secret is not None:
        return f"$({REDIS_URL_ENV})"
    if spec.redis.url is not None:
        return spec.redis.url
    host = f"{child_name(spec.name, 'redis')}.{spec.namespace}.svc"
    return f"redis://:$(REDIS_PASSWORD)@{host}:{REDIS_PORT}/0"


def redis_env(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """Environment variables that `redis_url` refers to."""
    if spec.redis.url_secret is not None:
        ref = spec.redis.url_secret
        return [_secret_env(REDIS_URL_ENV, ref.name, ref.key)]
    if spec.redis.is_managed:
        return [_secret_env("REDIS_PASSWORD", redis_password_secret(spec.name), "password")]
    return []


def _secret_env(var: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": var, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def render_children(spec: InferenceServiceSpec) -> list[Child]:
    """Every child of the service, in apply order (config and Redis before the pods)."""
    config_map = render_config_map(spec)
    # Generated Secrets are created once (and replaced only on request), never patched.
    children = [Child(config_map), Child(render_kv_transfer_key(spec), create_only=True)]
    if spec.redis.is_managed:
        secret, *rest = render_redis(spec)
        children += [Child(secret, create_only=True)] + [Child(m) for m in rest]
    ctx = PodContext(redis_url=redis_url(spec), redis_env=redis_env(spec),
                     config_map=config_map_name(spec), config_checksum=config_checksum(config_map))
    for pool in spec.pools.values():
        children += [Child(m) for m in render_pool(spec, pool, ctx)]
    children += [Child(m) for m in render_router(spec, ctx)]
    if spec.ingress is not None:
        children.append(Child(render_ingress(spec)))
    children += [Child(m) for m in render_network_policies(spec)]
    return children
