"""The real operator process (kopf, real HTTP, real watch streams) against kmock's emulator."""

from __future__ import annotations

from typing import Any

from kvferry.operator.children import HANDOVER_MANAGER
from kvferry.operator.kube import APPLY_CONTENT_TYPE, FIELD_MANAGER, ApiError, object_path
from kvferry.operator.render import render_children
from kvferry.operator.spec import parse_spec
from kvferry_testing.kube_emulator import new_service, operator_writes, stored, wait_for

NS = "default"
DISAGGREGATED = {
    "model": {"source": "demo"},
    "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 2}},
}


def versions(k: Any, plural: str, name: str) -> int:
    """How many versions of one object the emulator has stored."""
    for (resource, namespace, obj_name), obj in k.objects.items():
        if resource.plural == plural and namespace == NS and obj_name == name:
            return len(obj.history)
    return 0


def writes(k: Any, since: int) -> list[tuple[str, str, Any]]:
    """(method, path, body) of the writes the emulator served after request number `since`."""
    served = [(str(r.method.value).upper(), r.url.path, r.data) for r in k.served[since:]]
    return [w for w in served if w[0] in ("POST", "PATCH", "PUT", "DELETE")]


async def service_status(client: Any, name: str) -> dict[str, Any]:
    obj = await client.get("InferenceService", NS, name)
    return (obj or {}).get("status") or {}


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


async def create_and_settle(client: Any, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    body = new_service(name, spec)
    await client.create(NS, body)
    expected = render_children(parse_spec(body))

    async def all_exist() -> bool:
        for child in expected:
            if await client.get(child.kind, NS, child.name) is None:
                return False
        return bool((await service_status(client, name)).get("conditions"))

    await wait_for(all_exist, 20, f"children and status of {name}")
    return body


def test_apply_creates_owned_children_and_reacts_to_changes(cluster, run_async) -> None:
    async def scenario() -> None:
        async with cluster() as (k, client, start_operator), start_operator():
            body = await create_and_settle(client, "chat", DISAGGREGATED)
            uid = body["metadata"]["uid"]
            for child in render_children(parse_spec(body)):
                live = await client.get(child.kind, NS, child.name)
                (ref,) = live["metadata"]["ownerReferences"]
                assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
                    "InferenceService", "chat", uid, True)
            status = await service_status(client, "chat")
            assert status["pools"]["decode"] == {"replicas": 2, "readyReplicas": 0, "summary": "0/2"}
            assert condition(status, "Ready")["status"] == "False"
            assert status["url"] == "http://chat-router.default.svc:8000"

            # Scaling the decode pool patches that Deployment and nothing else.
            before = len(k.served)
            await client.apply(NS, {**_cr_patch("chat", 2), "spec": {"pools": {"decode": {"replicas": 3}}}})
            await wait_for(lambda: _replicas(k, "chat-decode") == 3, 15, "decode replicas 3")
            await wait_for(lambda: (status_generation(k, "chat") == 2), 15, "observedGeneration 2")
            child_writes = [(m, p) for m, p, _ in writes(k, before)
                            if "/inferenceservices/" not in p and not p.endswith("/events")]
            assert child_writes == [("PATCH", "/apis/apps/v1/namespaces/default/deployments/chat-decode")]

    run_async(scenario())


def test_autoscaling_takes_replicas_over_and_gives_them_back(cluster, run_async) -> None:
    async def scenario() -> None:
        async with cluster() as (k, client, start_operator), start_operator():
            spec = {**DISAGGREGATED, "pools": {"prefill": {}, "decode": {"replicas": 3}}}
            await create_and_settle(client, "chat", spec)
            before = len(k.served)
            scaling = {"minReplicas": 2, "maxReplicas": 6}
            await client.apply(NS, {**_cr_patch("chat", 2),
                                    "spec": {"pools": {"decode": {"autoscaling": scaling}}}})
            hpa = await wait_for(lambda: stored(k, "HorizontalPodAutoscaler", "chat-decode"), 15, "HPA")
            await wait_for(lambda: status_generation(k, "chat") == 2, 15, "observedGeneration 2")
            assert hpa["spec"]["scaleTargetRef"]["name"] == "chat-decode"
            assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
            assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm:num_requests_waiting"
            # HPA first, then a second field manager co-owns the running count, then the
            # operator's Deployment leaves replicas out: the pool never drops to 1.
            sent = [w for w in operator_writes(k, before) if "/inferenceservices/" not in w.path]
            assert [(w.path.rsplit("/", 2)[-2], w.params["fieldManager"], w.params["force"]) for w in sent] == [
                ("horizontalpodautoscalers", FIELD_MANAGER, "true"),
                ("deployments", HANDOVER_MANAGER, "false"),
                ("deployments", FIELD_MANAGER, "true"),
            ]
            assert sent[1].body["spec"] == {"replicas": 3}
            assert "replicas" not in sent[2].body["spec"]
            assert _replicas(k, "chat-decode") == 3

            # The HPA scales; the operator leaves that number alone and reports it.
            before = len(k.served)
            await _scale_by_hand(client, "chat-decode", 5)
            await wait_for(lambda: _pool_status(k, "chat", "decode") == 5, 15, "status follows the HPA")
            assert [w for w in operator_writes(k, before) if "/deployments/" in w.path] == []

            # Autoscaling removed: the HPA goes first, then replicas follow the spec again.
            before = len(k.served)
            await client._call("PATCH", object_path("InferenceService", NS, "chat"),
                               {"metadata": {"generation": 3}, "spec": {"pools": {"decode": {"autoscaling": None}}}},
                               "application/merge-patch+json")
            await wait_for(lambda: _replicas(k, "chat-decode") == 3, 15, "replicas back to the spec's 3")
            assert stored(k, "HorizontalPodAutoscaler", "chat-decode") is None
            sent = [w for w in operator_writes(k, before) if "/inferenceservices/" not in w.path]
            assert [(w.method, w.path.rsplit("/", 2)[-2]) for w in sent] == [
                ("DELETE", "horizontalpodautoscalers"), ("PATCH", "deployments")]
            assert sent[0].body["preconditions"]["uid"] == hpa["metadata"]["uid"]
            assert sent[1].body["spec"]["replicas"] == 3 and sent[1].params["force"] == "true"

    run_async(scenario())


async def _scale_by_hand(client: Any, deployment: str, replicas: int) -> None:
    """What the HPA controller (or kubectl scale) does: a plain update of the count."""
    await client._call("PATCH", object_path("Deployment", NS, deployment), {"spec": {"replicas": replicas}},
                       "application/merge-patch+json")


def test_ready_counts_restart_and_delete(cluster, run_async) -> None:
    async def scenario() -> None:
        async with cluster() as (k, client, start_operator):
            async with start_operator():
                await create_and_settle(client, "chat", DISAGGREGATED)
                for component, replicas in (("prefill", 1), ("decode", 2), ("router", 1), ("redis", 1)):
                    await client.patch_status("Deployment", NS, f"chat-{component}", {
                        "replicas": replicas, "readyReplicas": replicas, "updatedReplicas": replicas})
                status = await wait_for(
                    lambda: _ready_status(client, "chat"), 15, "Ready=True")
                assert status["pools"] == {
                    "prefill": {"replicas": 1, "readyReplicas": 1, "summary": "1/1"},
                    "decode": {"replicas": 2, "readyReplicas": 2, "summary": "2/2"},
                }
                assert condition(status, "Progressing")["status"] == "False"
                assert condition(status, "Degraded")["status"] == "False"
            creates = sum(1 for m, _, _ in writes(k, 0) if m == "POST")
            before = len(k.served)
            async with start_operator() as second:
                await wait_for(lambda: second.log_path.read_text().count("Resuming is processed") >= 1,
                               20, "the restarted operator to resume the service")
            restarted_writes = [(m, p) for m, p, _ in writes(k, before) if not p.endswith("/events")]
            assert restarted_writes == []
            assert sum(1 for m, _, _ in writes(k, 0) if m == "POST") == creates

            # No finalizer: deletion completes at once, with or without the operator.
            await client._call("DELETE", "/apis/kvferry.dev/v1alpha1/namespaces/default/inferenceservices/chat")
            assert await client.get("InferenceService", NS, "chat") is None

    run_async(scenario())


def test_missing_secret_and_invalid_spec_are_degraded_not_fatal(cluster, run_async) -> None:
    async def scenario() -> None:
        async with cluster() as (k, client, start_operator), start_operator() as operator:
            spec = {**DISAGGREGATED, "engine": {"imagePullSecrets": ["registry-creds"]}}
            await create_and_settle(client, "pull", spec)
            degraded = condition(await service_status(client, "pull"), "Degraded")
            assert (degraded["status"], degraded["reason"]) == ("True", "SecretNotFound")
            assert "spec.engine.imagePullSecrets[0]" in degraded["message"]

            # The emulator has no admission, so this reaches the operator as an old cluster would let it.
            bad = {"model": {"source": "demo"},
                   "pools": {"decode": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}}}
            await client.create(NS, new_service("bad", bad))
            status = await wait_for(lambda: service_status(client, "bad"), 15, "status of bad")
            degraded = condition(status, "Degraded")
            assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
            assert "spec.pools.decode.autoscaling.minReplicas" in degraded["message"]
            assert await client.get("Deployment", NS, "bad-decode") is None
            assert operator.proc is not None and operator.proc.returncode is None

    run_async(scenario())


def test_an_encoder_pool_runs_encoder_pods_and_a_decoder_only_one_is_refused(
        cluster, run_async) -> None:
    async def scenario() -> None:
        async with cluster() as (k, client, start_operator), start_operator() as operator:
            spec = {"model": {"source": "demo-whisper", "type": "encoder-decoder"},
                    "pools": {"encoder": {"autoscaling": {"maxReplicas": 3}},
                              "decode": {"replicas": 2}}}
            await create_and_settle(client, "speech", spec)
            encoder = stored(k, "Deployment", "speech-encoder")
            (container,) = encoder["spec"]["template"]["spec"]["containers"]
            assert container["args"][2:6] == ["--model", "demo-whisper", "--role", "encoder"]
            hpa = stored(k, "HorizontalPodAutoscaler", "speech-encoder")
            assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == \
                "kvferry:num_requests_waiting_for_encoder"
            (decode,) = stored(k, "Deployment", "speech-decode")["spec"]["template"]["spec"][
                "containers"]
            assert decode["args"][4:6] == ["--role", "decode"]

            # No admission in the emulator: the operator itself refuses it, in the status.
            bad = {"model": {"source": "demo"}, "pools": {"encoder": {}, "decode": {}}}
            await client.create(NS, new_service("textonly", bad))
            status = await wait_for(lambda: service_status(client, "textonly"), 15,
                                    "status of textonly")
            degraded = condition(status, "Degraded")
            assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
            assert degraded["message"] == (
                "spec.pools.encoder: spec.pools.encoder runs the encoder of an encoder-decoder "
                "model (BART, Whisper), and spec.model.type is decoder-only: set "
                "spec.model.type: encoder-decoder, or drop the encoder pool")
            for component in ("encoder", "decode"):
                assert await client.get("Deployment", NS, f"textonly-{component}") is None
            assert operator.proc is not None and operator.proc.returncode is None

    run_async(scenario())


async def _ready_status(client: Any, name: str) -> dict[str, Any] | None:
    status = await service_status(client, name)
    return status if condition(status, "Ready").get("status") == "True" else None


def _pool_status(k: Any, name: str, pool: str) -> int | None:
    for (resource, _, obj_name), obj in k.objects.items():
        if resource.plural == "inferenceservices" and obj_name == name and not obj.deleted:
            return ((obj.get("status") or {}).get("pools", {}).get(pool) or {}).get("replicas")
    return None


def status_generation(k: Any, name: str) -> int | None:
    for (resource, _, obj_name), obj in k.objects.items():
        if resource.plural == "inferenceservices" and obj_name == name and not obj.deleted:
            return (obj.get("status") or {}).get("observedGeneration")
    return None


def _replicas(k: Any, deployment: str) -> int | None:
    for (resource, _, name), obj in k.objects.items():
        if resource.plural == "deployments" and name == deployment and not obj.deleted:
            return obj["spec"].get("replicas")
    return None


def _cr_patch(name: str, generation: int) -> dict[str, Any]:
    """What the API server would do on a spec change: bump metadata.generation."""
    return {"apiVersion": "kvferry.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "generation": generation}}



def test_new_service_is_reconciled_once_with_one_write_per_child(cluster, run_async) -> None:
    async def scenario() -> None:
        async with cluster() as (k, client, start_operator), start_operator() as operator:
            body = new_service("chat", DISAGGREGATED)
            children = render_children(parse_spec(body))
            await wait_for(lambda: sum("watch=true" in str(r.url) for r in k.served) >= 7, 20,
                           "the operator's watch streams")
            before = len(k.served)
            await client.create(NS, body)
            # Read the emulator's memory, not the API, so every request below but the create is
            # the operator's.
            await wait_for(lambda: _status_conditions(k, "chat"), 15, "status of chat")
            await wait_for(lambda: "Handling cycle is finished" in operator.log_path.read_text(),
                           15, "kopf to finish with chat")
            served = [(str(r.method.value).upper(), r.url.path, r.headers.get("Content-Type"))
                      for r in k.served[before:] if "watch=true" not in str(r.url)]
            assert [m for m, p, _ in served if m == "GET"] == []
            # Server-side apply creates every child but the generated Secrets (the KV transfer
            # key, the Redis password), which are POSTed once.
            assert sorted(p for m, p, _ in served if m == "POST") == sorted(
                [object_path("InferenceService", NS)] + [object_path("Secret", NS)] * 2)
            service_path = object_path("InferenceService", NS, "chat")
            assert sorted(p for m, p, t in served if m == "PATCH" and t == APPLY_CONTENT_TYPE) == sorted(
                object_path(c.kind, NS, c.name) for c in children if c.kind != "Secret")
            assert sorted(p for m, p, t in served if m == "PATCH" and t != APPLY_CONTENT_TYPE) == [
                service_path, service_path + "/status"]
            assert operator.log_path.read_text().count("Handler 'reconcile' is invoked") == 1

    run_async(scenario())


def test_child_that_already_exists_is_compared_and_patched(cluster, run_async) -> None:
    async def scenario() -> None:
        async with cluster() as (k, client, start_operator), start_operator():
            body = new_service("chat", DISAGGREGATED)
            config = next(c for c in render_children(parse_spec(body)) if c.kind == "ConfigMap")
            await client.create(NS, {**config.manifest, "data": {"KVFERRY_SERVICE": "stale"}})
            await create_and_settle(client, "chat", DISAGGREGATED)
            live = await client.get("ConfigMap", NS, config.name)
            assert live["data"] == config.manifest["data"]
            assert versions(k, "configmaps", config.name) == 2  # created by hand, then patched once

    run_async(scenario())


def test_emulator_versions_writes_and_answers_by_key(cluster, run_async) -> None:
    async def scenario() -> None:
        async with cluster() as (k, client, _):
            for name in ("a", "b", "c"):
                await client.create(NS, new_service(name, DISAGGREGATED))
            await client.patch_status("InferenceService", NS, "b", {"url": "http://b"})
            b = await client.get("InferenceService", NS, "b")
            assert (b["metadata"]["name"], b["status"]) == ("b", {"url": "http://b"})
            assert [(await client.get("InferenceService", NS, n))["metadata"]["resourceVersion"]
                    for n in ("a", "b", "c")] == ["1", "4", "3"]
            assert await client.get("InferenceService", NS, "d") is None
            assert await client.get("InferenceService", "elsewhere", "a") is None
            try:
                await client.create(NS, new_service("a", DISAGGREGATED))
            except ApiError as exc:
                assert exc.status == 409
            else:
                raise AssertionError("a second create of the same name must conflict")

    run_async(scenario())


def _status_conditions(k: Any, name: str) -> list[Any]:
    for (resource, _, obj_name), obj in k.objects.items():
        if resource.plural == "inferenceservices" and obj_name == name and not obj.deleted:
            return (obj.get("status") or {}).get("conditions") or []
    return []
