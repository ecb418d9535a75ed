"""A small asynchronous Kubernetes API client for the operator's children.

kopf owns the watch streams of the operator; this client does the rest (get, create,
server-side apply, status patches) over the same `kopf.ConnectionInfo` kopf logged in with,
so both speak to the same API server with the same credentials.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

FIELD_MANAGER = "kvferry-operator"

# kind -> (apiVersion, plural) of everything the operator reads or writes.
RESOURCES: dict[str, tuple[str, str]] = {
    "ConfigMap": ("v1", "configmaps"),
    "Secret": ("v1", "secrets"),
    "Service": ("v1", "services"),
    "Deployment": ("apps/v1", "deployments"),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
    "HorizontalPodAutoscaler": ("autoscaling/v2", "horizontalpodautoscalers"),
    "Ingress": ("networking.k8s.io/v1", "ingresses"),
    "InferenceService": ("kvferry.dev/v1alpha1", "inferenceservices"),
}


class ApiError(Exception):
    """A non-2xx answer of the API server."""

    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        self.status = status
        super().__init__(f"{method} {path}: HTTP {status}: {message}")


def object_path(kind: str, namespace: str, name: str | None = None) -> str:
    """REST path of a namespaced object (or of its collection when `name` is None)."""
    api_version, plural = RESOURCES[kind]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


@dataclass
class KubeClient:
    """Talks to the API server that `info` (from kopf's login) describes."""

    info: kopf.ConnectionInfo
    _session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            ssl = False if self.info.insecure else self.info.as_ssl_context()
            self._session = aiohttp.ClientSession(
                base_url=self.info.server.rstrip("/") + "/",
                headers=self.info.as_http_headers(),
                connector=aiohttp.TCPConnector(ssl=ssl, limit=32),
                timeout=aiohttp.ClientTimeout(total=30),
            )
        return self._session

    async def close(self) -> None:
        """Close the connection pool."""
        if self._session is not None:
            await self._session.close()

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None,
                    content_type: str = "application/json",
                    params: dict[str, str] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        async with self._http().request(method, path.lstrip("/"), data=data, headers=headers,
                                        params=params) as resp:
            text = await resp.text()
            if resp.status >= 300:
                raise ApiError(resp.status, method, path, text[:500])
            return json.loads(text) if text else {}

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The live object, or None when it does not exist."""
        try:
            return await self._call("GET", object_path(kind, namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def create(self, namespace: str, manifest: dict[str, Any]) -> dict[str, Any]:
        """POST a new object."""
        return await self._call("POST", object_path(manifest["kind"], namespace), manifest,
                                params={"fieldManager": FIELD_MANAGER})

    async def apply(self, namespace: str, manifest: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply: the operator owns exactly the fields it renders.

        Fields it stops rendering are removed by the API server; fields others own (an
        HPA's replicas, defaults) are left alone.
        """
        path = object_path(manifest["kind"], namespace, manifest["metadata"]["name"])
        return await self._call("PATCH", path, manifest, "application/apply-patch+yaml",
                                params={"fieldManager": FIELD_MANAGER, "force": "true"})

    async def patch_status(self, kind: str, namespace: str, name: str,
                           status: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch the `status` subresource."""
        path = object_path(kind, namespace, name) + "/status"
        return await self._call("PATCH", path, {"status": status}, "application/merge-patch+json")
