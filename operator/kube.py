"""A small asynchronous Kubernetes API client for the operator's children.

kopf owns the watch streams of the operator; this client does the rest (get, list by label,
server-side apply, delete with a uid precondition, status patches) over the same
`kopf.ConnectionInfo` kopf logged in with, so both speak to the same API server with the
same credentials.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

FIELD_MANAGER = "kvferry-operator"
"""The field manager of every server-side apply: the operator owns what it renders."""

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"  # JSON is YAML, so a JSON body is sent
USER_AGENT = "kvferry-operator"

# kind -> (apiVersion, plural) of everything the operator reads or writes.
RESOURCES: dict[str, tuple[str, str]] = {
    "ConfigMap": ("v1", "configmaps"),
    "Secret": ("v1", "secrets"),
    "Service": ("v1", "services"),
    "Deployment": ("apps/v1", "deployments"),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
    "HorizontalPodAutoscaler": ("autoscaling/v2", "horizontalpodautoscalers"),
    "Ingress": ("networking.k8s.io/v1", "ingresses"),
    "NetworkPolicy": ("networking.k8s.io/v1", "networkpolicies"),
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
    user_agent: str = USER_AGENT
    _session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            ssl = False if self.info.insecure else self.info.as_ssl_context()
            self._session = aiohttp.ClientSession(
                base_url=self.info.server.rstrip("/") + "/",
                headers={**self.info.as_http_headers(), "User-Agent": self.user_agent},
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

    async def list_by_labels(self, kind: str, namespace: str,
                             label_selector: dict[str, str]) -> list[dict[str, Any]]:
        """Objects of one kind in a namespace with all the given labels.

        List items come without `apiVersion` and `kind`; they are filled in, so an item
        compares like the object a GET returns.
        """
        selector = ",".join(f"{k}={v}" for k, v in label_selector.items())
        found = await self._call("GET", object_path(kind, namespace), params={"labelSelector": selector})
        api_version, _ = RESOURCES[kind]
        return [{"apiVersion": api_version, "kind": kind, **item} for item in found.get("items") or []]

    async def create(self, namespace: str, manifest: dict[str, Any]) -> dict[str, Any]:
        """POST a new object."""
        return await self._call("POST", object_path(manifest["kind"], namespace), manifest,
                                params={"fieldManager": FIELD_MANAGER})

    async def apply(self, namespace: str, manifest: dict[str, Any], field_manager: str = FIELD_MANAGER,
                    force: bool = True) -> dict[str, Any]:
        """Server-side apply, which creates the object when it does not exist.

        The field manager owns exactly the fields in `manifest`: a field it applied before
        and leaves out now is removed by the API server (unless another manager owns it
        too). `force` takes over fields another manager changed, which is how the operator
        puts back a child edited by hand.
        """
        path = object_path(manifest["kind"], namespace, manifest["metadata"]["name"])
        params = {"fieldManager": field_manager, "force": "true" if force else "false"}
        return await self._call("PATCH", path, manifest, APPLY_CONTENT_TYPE, params=params)

    async def delete(self, kind: str, namespace: str, name: str, uid: str) -> bool:
        """Delete the object named `name` only if its uid is still `uid`; dependents go too.

        Returns False when it is gone already or the name now belongs to another object.
        """
        options = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background",
                   "preconditions": {"uid": uid}}
        try:
            await self._call("DELETE", object_path(kind, namespace, name), options)
        except ApiError as exc:
            if exc.status in (404, 409):
                return False
            raise
        return True

    async def patch_status(self, kind: str, namespace: str, name: str,
                           status: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch the `status` subresource."""
        path = object_path(kind, namespace, name) + "/status"
        return await self._call("PATCH", path, {"status": status}, "application/merge-patch+json")
