"""Run the real operator against kmock's in-memory Kubernetes API server (tests, benchmarks).

`emulated_cluster()` starts a `kmock.KubernetesEmulator` on 127.0.0.1 with every resource
the operator watches or writes registered for discovery; `OperatorProcess` runs
`kvferry operator` as a child process that logs in through a kubeconfig pointing at it.
The emulator has no garbage collector, defaulting or admission: those are covered by the
schema tests and by `e2e/kind.sh` on a real cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import attrs
import kmock
import kopf
import yaml
from kvferry.operator import API_VERSION, KIND
from kvferry.operator.kube import APPLY_CONTENT_TYPE, RESOURCES, KubeClient

ALL_VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}
TEST_USER_AGENT = "kvferry-tests"
"""User-Agent of the tests' own client, so the operator's requests can be told apart."""


class Emulator(kmock.KubernetesEmulator):
    """`kmock.KubernetesEmulator`, closer to a real API server and with a cost per request
    that does not grow with the cluster.

    Differences from kmock's own behaviour, all towards a real API server:

    - Request log: kmock matches each new request against its reactions by scanning every
      request served so far. This keeps only the current request in kmock's own list and
      the whole log in `served`.
    - Lookups: kmock finds the object of a get, create, patch or delete by scanning every
      object it stores; here it is one dict lookup by (resource, namespace, name). A
      not-found answer carries the object's name as a real one does, not a formatted
      Python traceback.
    - `metadata.resourceVersion`: every create and patch stamps a new one, as the API
      server does. kopf relies on it to tell a stale watch event (one sent before its own
      last patch) from a current one; without it, kopf reprocesses each object once more
      after the operator's own status write.
    - `metadata.uid` is set on create when the body has none.
    - A server-side apply (`application/apply-patch+yaml`) of an object that does not exist
      creates it. (An apply to an existing object is still kmock's plain merge: a field the
      applier leaves out is not removed, as server-side apply would remove it. Tests of that
      look at the request bodies.)
    - A list honours `labelSelector` (equality terms), and a delete honours
      `preconditions.uid` (409 when the name now belongs to another object).
    """

    @property
    def served(self) -> list[kmock.Request]:
        """Every request served, oldest first."""
        if "_served" not in self.__dict__:
            self.__dict__["_served"] = []
        return self.__dict__["_served"]

    async def _handle(self, request: kmock.Request) -> Any:
        self.served.append(request)
        del self._requests[:-1]
        if self._is_apply_of_missing(request):
            # kmock's reactions only see requests from its own log: log the changed one.
            request = self._requests[-1] = attrs.evolve(request, action=kmock.action.CREATE)
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            request.data.setdefault("metadata", {}).setdefault("uid", str(uuid.uuid4()))
        if request.action in (kmock.action.CREATE, kmock.action.UPDATE) and isinstance(request.data, dict):
            self._stamp_resource_version(request.data)
        if request.action == kmock.action.DELETE:
            self._check_preconditions(request)
        return await super()._handle(request)

    def _is_apply_of_missing(self, request: kmock.Request) -> bool:
        if request.action != kmock.action.UPDATE or request.subresource:
            return False
        if not request.headers.get("Content-Type", "").startswith(APPLY_CONTENT_TYPE):
            return False
        key = (request.resource, request.namespace, request.name)
        return key not in self.objects or self.objects[key].deleted

    def _check_preconditions(self, request: kmock.Request) -> None:
        options = request.data if isinstance(request.data, dict) else {}
        wanted = options.get("preconditions") or {}
        key = (request.resource, request.namespace, request.name)
        if "uid" not in wanted or key not in self.objects or self.objects[key].deleted:
            return
        actual = (self.objects[key].get("metadata") or {}).get("uid")
        if actual != wanted["uid"]:
            raise kmock.KubernetesError(
                status=409, reason="Conflict",
                message=f"Precondition failed: UID in precondition: {wanted['uid']}, UID in object meta: {actual}")

    async def _serve_list(self, request: kmock.Request) -> Any:
        listing = await super()._serve_list(request)
        terms = [t.split("=", 1) for t in request.params.get("labelSelector", "").split(",") if t]
        items = [item for item in listing["items"]
                 if all((item.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in terms)]
        return {**listing, "items": items}

    def _stamp_resource_version(self, data: dict[str, Any]) -> None:
        # A write's body is what kmock stores (create) or merges (patch), so the stamp
        # lands in the stored object and in the watch event kmock sends for it.
        version = self.__dict__.get("_resource_version", 0) + 1
        self.__dict__["_resource_version"] = version
        metadata = data.get("metadata")
        if not isinstance(metadata, dict):
            metadata = data["metadata"] = {}
        metadata["resourceVersion"] = str(version)

    def _live(self, request: kmock.Request, namespace: str | None, name: str | None) -> kmock.Object:
        key = (request.resource, namespace, name)
        obj = self.objects[key] if key in self.objects else None
        if obj is None or obj.deleted:
            raise kmock.KubernetesObjectNotFoundError(
                details={"name": name, "kind": request.resource.plural if request.resource else None})
        return obj

    async def _serve_fetch(self, request: kmock.Request) -> Any:
        return self._live(request, request.namespace, request.name).raw

    async def _serve_create(self, request: kmock.Request) -> Any:
        # The collection URL of a create names no object; the body does.
        metadata = request.data.get("metadata", {})
        namespace = request.namespace or metadata.get("namespace")
        return self._live(request, namespace, request.name or metadata.get("name")).raw

    async def _serve_update(self, request: kmock.Request) -> Any:
        return self._live_or_last(request).last.raw

    async def _serve_delete(self, request: kmock.Request) -> Any:
        return self._live_or_last(request).last.raw

    def _live_or_last(self, request: kmock.Request) -> kmock.Object:
        # kmock has already applied the patch or delete; a just-deleted object answers
        # with its last state, as the API server does.
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects:
            raise kmock.KubernetesObjectNotFoundError(details={"name": request.name})
        return self.objects[key]


def register_resources(k: kmock.KubernetesEmulator) -> None:
    """Make discovery list what kopf and the operator use."""
    for kind, (api_version, plural) in RESOURCES.items():
        k.resources[f"{api_version}/{plural}"] = kmock.ResourceInfo(
            kind=kind, namespaced=True, verbs=ALL_VERBS,
            subresources={"status"} if kind in (KIND, "Deployment") else set())
    k.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs={"list", "watch", "get"})
    k.resources["v1/namespaces"] = kmock.ResourceInfo(
        kind="Namespace", namespaced=False, verbs={"list", "watch", "get"})
    k.resources["v1/events"] = kmock.ResourceInfo(kind="Event", namespaced=True, verbs={"create"})


@contextlib.asynccontextmanager
async def emulated_cluster() -> AsyncIterator[tuple[Emulator, KubeClient]]:
    """An emulator serving on 127.0.0.1 and a client logged in to it."""
    async with Emulator() as k, kmock.Server(k):
        register_resources(k)
        client = KubeClient(kopf.ConnectionInfo(server=str(k.url), insecure=True), user_agent=TEST_USER_AGENT)
        try:
            yield k, client
        finally:
            await client.close()


def write_kubeconfig(path: Path, server: str) -> Path:
    """A kubeconfig whose current context is the emulator."""
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": "emulator", "user": {}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "emulator"}}],
    }
    path.write_text(yaml.safe_dump(config))
    return path


class OperatorProcess:
    """`kvferry operator` as a child process, stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, kubeconfig: Path, log_path: Path, *extra_args: str) -> None:
        self.kubeconfig = kubeconfig
        self.log_path = log_path
        self.extra_args = extra_args
        self.proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> OperatorProcess:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        with open(self.log_path, "ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvferry.cli", "operator", "--verbose", *self.extra_args,
                env=env, stdout=log, stderr=log)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> int | None:
        """Stop the process and return its exit status."""
        if self.proc is None or self.proc.returncode is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.terminate()
        try:
            return await asyncio.wait_for(self.proc.wait(), timeout=10)
        except TimeoutError:
            self.proc.kill()
            return await self.proc.wait()


def new_service(name: str, spec: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
    """An InferenceService as the API server would store it (uid and generation set)."""
    return {
        "apiVersion": API_VERSION, "kind": KIND,
        "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4()), "generation": 1},
        "spec": spec,
    }


async def wait_for(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """Poll `check()` until it returns something truthy; TimeoutError naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


WRITE_METHODS = ("POST", "PATCH", "PUT", "DELETE")


@dataclasses.dataclass(frozen=True)
class Sent:
    """One request the operator sent, as the emulator received it."""

    method: str
    path: str
    params: dict[str, str]
    content_type: str
    body: Any
    user_agent: str = ""  # kopf's, or the operator's own client's


def operator_requests(k: Emulator, since: int = 0) -> list[Sent]:
    """The requests after number `since` that did not come from the tests' own client."""
    return [
        Sent(str(r.method.value).upper(), r.url.path, dict(r.params), r.headers.get("Content-Type", ""), r.data,
             r.headers.get("User-Agent", ""))
        for r in k.served[since:] if r.headers.get("User-Agent") != TEST_USER_AGENT
    ]


def operator_writes(k: Emulator, since: int = 0, events: bool = False) -> list[Sent]:
    """The operator's writes after request number `since` (Kubernetes Events left out unless asked)."""
    return [s for s in operator_requests(k, since)
            if s.method in WRITE_METHODS and (events or not s.path.endswith("/events"))]


def stored(k: Emulator, kind: str, name: str, namespace: str = "default") -> dict[str, Any] | None:
    """The object as the emulator holds it now (None when missing or deleted)."""
    api_version, plural = RESOURCES[kind]
    key = (kmock.resource(f"{api_version}/{plural}"), namespace, name)
    if key not in k.objects or k.objects[key].deleted:
        return None
    return dict(k.objects[key].raw)
