"""The requests the operator's client sends, as a recording HTTP server receives them."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp.web
import kopf
import pytest

from kvferry.operator.children import HANDOVER_MANAGER
from kvferry.operator.kube import KubeClient
from kvferry.operator.reconcile import desired_children
from kvferry.operator.spec import parse_spec
from kvferry_testing.operator_factories import EXAMPLES, load_example, random_spec, service
from kvferry_testing.stored_form import stored_form_problems


@dataclass
class Received:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any


@dataclass
class Recorder:
    """An HTTP server that records every request and answers with `reply(request)`."""

    reply: Callable[[Received], tuple[int, Any]] = lambda r: (200, r.body or {})
    received: list[Received] = field(default_factory=list)

    async def handle(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        text = await request.text()
        got = Received(request.method, request.path, dict(request.query), dict(request.headers),
                       json.loads(text) if text else None)
        self.received.append(got)
        status, payload = self.reply(got)
        return aiohttp.web.json_response(payload, status=status)


async def with_client(recorder: Recorder, use: Callable[[KubeClient], Awaitable[Any]]) -> Any:
    app = aiohttp.web.Application()
    app.router.add_route("*", "/{tail:.*}", recorder.handle)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = KubeClient(kopf.ConnectionInfo(server=f"http://127.0.0.1:{port}", insecure=True))
    try:
        return await use(client)
    finally:
        await client.close()
        await runner.cleanup()


def run(recorder: Recorder, use: Callable[[KubeClient], Awaitable[Any]]) -> Any:
    return asyncio.run(with_client(recorder, use))


SERVICE = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "chat-router"},
           "spec": {"ports": [{"name": "http", "port": 8000}]}}


def test_apply_is_a_forced_server_side_apply_by_the_operator() -> None:
    recorder = Recorder()
    run(recorder, lambda c: c.apply("team-a", SERVICE))
    (sent,) = recorder.received
    assert (sent.method, sent.path) == ("PATCH", "/api/v1/namespaces/team-a/services/chat-router")
    assert sent.headers["Content-Type"] == "application/apply-patch+yaml"
    assert sent.query == {"fieldManager": "kvferry-operator", "force": "true"}
    assert sent.body == SERVICE
    assert sent.headers["User-Agent"] == "kvferry-operator"


def test_the_replicas_handover_is_an_unforced_apply_by_its_own_manager() -> None:
    recorder = Recorder()
    body = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "chat-decode"},
            "spec": {"replicas": 3}}
    run(recorder, lambda c: c.apply("team-a", body, field_manager=HANDOVER_MANAGER, force=False))
    (sent,) = recorder.received
    assert sent.path == "/apis/apps/v1/namespaces/team-a/deployments/chat-decode"
    assert sent.query == {"fieldManager": "kvferry-handover-to-hpa", "force": "false"}
    assert sent.body == body


@pytest.mark.parametrize(("status", "deleted"), [(200, True), (404, False), (409, False)])
def test_delete_carries_the_uid_precondition(status: int, deleted: bool) -> None:
    recorder = Recorder(reply=lambda r: (status, {"kind": "Status"}))
    result = run(recorder, lambda c: c.delete("HorizontalPodAutoscaler", "team-a", "chat-decode", "uid-1"))
    (sent,) = recorder.received
    assert (sent.method, sent.path) == (
        "DELETE", "/apis/autoscaling/v2/namespaces/team-a/horizontalpodautoscalers/chat-decode")
    assert sent.body == {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background",
                         "preconditions": {"uid": "uid-1"}}
    assert result is deleted


def test_list_selects_by_labels_and_fills_in_the_kind() -> None:
    recorder = Recorder(reply=lambda r: (200, {"kind": "DeploymentList", "items": [{"metadata": {"name": "a"}}]}))
    items = run(recorder, lambda c: c.list_by_labels("Deployment", "team-a", {"x": "1", "y": "2"}))
    (sent,) = recorder.received
    assert (sent.method, sent.path, sent.query) == (
        "GET", "/apis/apps/v1/namespaces/team-a/deployments", {"labelSelector": "x=1,y=2"})
    assert items == [{"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "a"}}]


def test_status_is_a_merge_patch_of_the_subresource() -> None:
    recorder = Recorder()
    run(recorder, lambda c: c.patch_status("InferenceService", "team-a", "chat", {"url": "u"}))
    (sent,) = recorder.received
    assert (sent.method, sent.path) == (
        "PATCH", "/apis/kvferry.dev/v1alpha1/namespaces/team-a/inferenceservices/chat/status")
    assert sent.headers["Content-Type"] == "application/merge-patch+json"
    assert sent.body == {"status": {"url": "u"}}


def owned(obj: dict[str, Any]) -> dict[str, Any]:
    return {**obj, "metadata": {**obj["metadata"], "uid": "uid-of-svc"}}


SPECS = [load_example(p) for p in EXAMPLES] + [
    owned(service(random_spec(random.Random(seed)), name=f"svc{seed}")) for seed in range(24)]


@pytest.mark.parametrize("obj", SPECS, ids=lambda o: o["metadata"]["name"])
def test_applied_bodies_are_what_the_api_server_stores(obj: dict[str, Any]) -> None:
    """Every body sent is in stored form, so reading it back compares equal and a restart
    of the operator writes nothing."""
    obj = owned(obj)
    children = desired_children(parse_spec(obj), obj)
    recorder = Recorder()

    async def apply_all(client: KubeClient) -> None:
        for child in children:
            await client.apply(obj["metadata"].get("namespace", "default"), child.manifest)

    run(recorder, apply_all)
    assert [r.body for r in recorder.received] == [c.manifest for c in children]
    for child, sent in zip(children, recorder.received):
        assert stored_form_problems(sent.body, f"{child.kind}/{child.name}") == []


def test_the_stored_form_check_catches_what_the_api_server_rewrites() -> None:
    body = {"spec": {"volumeMounts": [], "publishNotReadyAddresses": False, "allowPrivilegeEscalation": False,
                     "resources": {"limits": {"cpu": "1000m", "memory": "1Gi"}}, "emptyDir": {"sizeLimit": "1024Mi"},
                     "labels": {}, "stringData": {"p": "x"}}}
    assert stored_form_problems(body) == [
        ".spec.volumeMounts: empty list (dropped by the API server)",
        ".spec.publishNotReadyAddresses: false (dropped by the API server)",
        ".spec.resources.limits.cpu: '1000m' is stored as '1'",
        ".spec.emptyDir.sizeLimit: '1024Mi' is stored as '1Gi'",
        ".spec.labels: empty map (dropped by the API server)",
        ".spec.stringData: write-only (stored as data)",
    ]
