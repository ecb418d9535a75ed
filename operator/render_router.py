"""Render the router (Deployment and Service) and the optional Ingress in front of it."""

from __future__ import annotations

from typing import Any

from kvferry.operator.images import router_image
from kvferry.operator.labels import (
    HTTP_PORT,
    child_name,
    labels,
    scrape_annotations,
    selector_labels,
)
from kvferry.operator.render_kv_key import kv_transfer_key_annotations, kv_transfer_key_env
from kvferry.operator.render_pod import (
    CONFIG_CHECKSUM_ANNOTATION,
    TMP_SIZE_LIMIT,
    apply_overrides,
    container_security_context,
    empty_dir,
    http_probes,
    pod_metadata,
    pod_security_context,
    resources_manifest,
)
from kvferry.operator.render_pools import (
    RUN_AS_USER,
    PodContext,
    model_arg,
    model_volumes,
    termination_grace_seconds,
)
from kvferry.operator.spec import InferenceServiceSpec

API_KEY_DIR = "/etc/kvferry/api-key"
ROUTER_STARTUP_SECONDS = 120  # the router loads no model; it only needs Redis


def router_args(spec: InferenceServiceSpec, redis_url: str) -> list[str]:
    """The `kvferry router` command line (the contract of ARCHITECTURE.md)."""
    args = [
        "kvferry", "router",
        "--service", spec.name,
        "--redis", redis_url,
        "--host", "0.0.0.0",
        "--port", str(HTTP_PORT),
    ]
    if spec.router.api_key_secret is not None:
        args += ["--api-key-file", f"{API_KEY_DIR}/{spec.router.api_key_secret.key}"]
    return args


def render_router_deployment(spec: InferenceServiceSpec, ctx: PodContext) -> dict[str, Any]:
    """The router's Deployment; the API key Secret is mounted as a file when set.

    Weights on a claim (pvc) are mounted read-only here too, so the router loads the
    engines' tokenizer from them and hashes text prompts without asking a pod; for demo, hub
    and hostPath models (a hostPath would take the router out of the restricted Pod Security
    level) it asks a pod's /tokenize.
    """
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    volumes: list[dict[str, Any]] = [empty_dir("tmp", TMP_SIZE_LIMIT)]
    env = [*ctx.redis_env, kv_transfer_key_env(spec)]
    model_volumes_, model_mounts = model_volumes(spec)
    if spec.model.source_scheme == "pvc":
        volumes += model_volumes_
        mounts += model_mounts
        env.append({"name": "KVFERRY_ROUTER_TOKENIZER", "value": model_arg(spec)})
    if spec.router.api_key_secret is not None:
        volumes.append({"name": "api-key", "secret": {"secretName": spec.router.api_key_secret.name}})
        mounts.append({"name": "api-key", "mountPath": API_KEY_DIR, "readOnly": True})
    container: dict[str, Any] = {
        "name": "router",
        "image": router_image(spec),
        "imagePullPolicy": spec.engine.image_pull_policy,
        "args": router_args(spec, ctx.redis_url),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "envFrom": [{"configMapRef": {"name": ctx.config_map}}],
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
        **http_probes(ROUTER_STARTUP_SECONDS),
    }
    container["env"] = env
    resources = resources_manifest(spec.router.resources)
    if resources:
        container["resources"] = resources
    # The router drains for $KVFERRY_DRAIN_SECONDS (the ConfigMap) as the engines do, so it
    # gets their grace period: a request in flight on a rollout still gets its answer.
    pod = {"securityContext": pod_security_context(RUN_AS_USER), "containers": [container],
           "volumes": volumes, "terminationGracePeriodSeconds": termination_grace_seconds(spec)}
    pod_labels = labels(spec.name, "router")
    annotations = {**scrape_annotations(), CONFIG_CHECKSUM_ANNOTATION: ctx.config_checksum,
                   **kv_transfer_key_annotations(spec)}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": child_name(spec.name, "router"), "labels": pod_labels},
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": selector_labels(spec.name, "router")},
            "template": {
                "metadata": pod_metadata(pod_labels, annotations, spec.router.pod),
                "spec": apply_overrides(pod, spec.router.pod, spec.engine.image_pull_secrets),
            },
        },
    }


def render_router_service(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The ClusterIP Service clients (and the Ingress) reach the router by."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": child_name(spec.name, "router"), "labels": labels(spec.name, "router")},
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(spec.name, "router"),
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_router(spec: InferenceServiceSpec, ctx: PodContext) -> list[dict[str, Any]]:
    """The router's Deployment and Service."""
    return [render_router_deployment(spec, ctx), render_router_service(spec)]


def render_ingress(spec: InferenceServiceSpec) -> dict[str, Any]:
    """An Ingress routing every path of `spec.ingress.host` (or any host) to the router."""
    ingress = spec.ingress
    if ingress is None:
        raise ValueError("spec.ingress: render_ingress needs it set")
    backend = {"service": {"name": child_name(spec.name, "router"), "port": {"name": "http"}}}
    rule: dict[str, Any] = {"http": {"paths": [{"path": "/", "pathType": "Prefix", "backend": backend}]}}
    if ingress.host:
        rule = {"host": ingress.host, **rule}
    body: dict[str, Any] = {"rules": [rule]}
    if ingress.class_name:
        body = {"ingressClassName": ingress.class_name, **body}
    if ingress.tls_secret_name and ingress.host:
        body["tls"] = [{"hosts": [ingress.host], "secretName": ingress.tls_secret_name}]
    metadata: dict[str, Any] = {"name": child_name(spec.name, "router"), "labels": labels(spec.name, "router")}
    if ingress.annotations:
        metadata["annotations"] = dict(ingress.annotations)
    return {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": metadata, "spec": body}


def service_url(spec: InferenceServiceSpec) -> str:
    """Where clients reach the service: the Ingress host, else the router's cluster DNS name."""
    if spec.ingress is not None and spec.ingress.host:
        scheme = "https" if spec.ingress.tls_secret_name else "http"
        return f"{scheme}://{spec.ingress.host}"
    return f"http://{child_name(spec.name, 'router')}.{spec.namespace}.svc:{HTTP_PORT}"
