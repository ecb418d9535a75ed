"""The operator process keeps children in line with the spec: prunes, applies, puts back."""

from __future__ import annotations

from typing import Any

from kvferry.operator.children import APPLIED_ANNOTATION
from kvferry.operator.kube import APPLY_CONTENT_TYPE, FIELD_MANAGER, object_path
from kvferry.operator.render_pod import CONFIG_CHECKSUM_ANNOTATION
from kvferry_testing.kube_emulator import new_service, operator_writes, stored, wait_for

NS = "default"
BASE = {"model": {"source": "demo"}, "pools": {"decode": {}}}


async def create(client: Any, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    body = new_service(name, spec)
    await client.create(NS, body)
    return body


async def change_spec(client: Any, name: str, generation: int, spec_patch: dict[str, Any]) -> None:
    """A spec change as the API server records it (merge patch, generation bumped)."""
    await client._call("PATCH", object_path("InferenceService", NS, name),
                       {"metadata": {"generation": generation}, "spec": spec_patch}, "application/merge-patch+json")


def observed(k: Any, name: str) -> int | None:
    return ((stored(k, "InferenceService", name) or {}).get("status") or {}).get("observedGeneration")


def condition(k: Any, name: str, kind: str) -> dict[str, Any]:
    status = (stored(k, "InferenceService", name) or {}).get("status") or {}
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


def test_removing_a_pool_deletes_its_four_children_by_uid(cluster, run_async) -> None:
    async def scenario() -> None:
        async with cluster() as (k, client, start_operator), start_operator():
            spec = {**BASE, "pools": {"prefill": {"autoscaling": {"maxReplicas": 3}}, "decode": {}}}
            await create(client, "chat", spec)
            await wait_for(lambda: observed(k, "chat") == 1, 15, "first reconcile")
            kinds = ("HorizontalPodAutoscaler", "Deployment", "Service", "PodDisruptionBudget")
            uids = {kind: stored(k, kind, "chat-prefill")["metadata"]["uid"] for kind in kinds}
            before = len(k.served)
            await change_spec(client, "chat", 2, {"pools": {"prefill": None}})
            await wait_for(lambda: observed(k, "chat") == 2, 15, "second reconcile")
            assert [kind for kind in kinds if stored(k, kind, "chat-prefill")] == []
            deletes = [w for w in operator_writes(k, before) if w.method == "DELETE"]
            # The HPA first: it must not rescale a Deployment that is about to go.
            assert deletes[0].path == object_path("HorizontalPodAutoscaler", NS, "chat-prefill")
            by_path = {w.path: w.body["preconditions"]["uid"] for w in deletes}
            assert by_path == {object_path(kind, NS, "chat-prefill"): uids[kind] for kind in kinds}
            assert {w.body["propagationPolicy"] for w in deletes} == {"Background"}
            assert stored(k, "Deployment", "chat-decode") is not None  # the other pool stays

    run_async(scenario())


def test_removing_the_ingress_deletes_it(cluster, run_async) -> None:
    async def scenario() -> None:
        async with cluster() as (k, client, start_operator), start_operator():
            await create(client, "chat", {**BASE, "ingress": {"host": "llm.example.com"}})
            await wait_for(lambda: stored(k, "Ingress", "chat-router"), 15, "the Ingress")
            await change_spec(client, "chat", 2, {"ingress": None})
            await wait_for(lambda: stored(k, "Ingress", "chat-router") is None, 15, "the Ingress deleted")
            assert stored(k, "Service", "chat-router") is not None

    run_async(scenario())


def test_network_policies_follow_the_spec(cluster, run_async) -> None:
    async def scenario() -> None:
        async with cluster() as (k, client, start_operator), start_operator():
            await create(client, "chat", BASE)
            # The Redis policy is applied last of all the children.
            await wait_for(lambda: stored(k, "NetworkPolicy", "chat-redis"), 15,
                           "the Redis NetworkPolicy")
            assert stored(k, "NetworkPolicy", "chat-engines") is not None
            await change_spec(client, "chat", 2, {"networkPolicy": {"enabled": False}})
            await wait_for(lambda: stored(k, "NetworkPolicy", "chat-engines") is None
                           and stored(k, "NetworkPolicy", "chat-redis") is None, 15,
                           "the NetworkPolicies deleted")
            assert stored(k, "Deployment", "chat-decode") is not None

    run_async(scenario())


def test_naming_an_external_redis_deletes_the_managed_one(cluster, run_async) -> None:
    async def scenario() -> None:
        async with cluster() as (k, client, start_operator), start_operator():
            await create(client, "chat", BASE)
            await wait_for(lambda: observed(k, "chat") == 1, 15, "first reconcile")
            assert stored(k, "Secret", "chat-redis-auth") is not None
            await change_spec(client, "chat", 2, {"redis": {"url": "redis://shared:6379/0"}})
            await wait_for(lambda: observed(k, "chat") == 2, 15, "second reconcile")
            gone = [(kind, name) for kind, name in (("Deployment", "chat-redis"), ("Service", "chat-redis"),
                                                    ("Secret", "chat-redis-auth")) if stored(k, kind, name)]
            assert gone == []
            args = stored(k, "Deployment", "chat-decode")["spec"]["template"]["spec"]["containers"][0]["args"]
            assert args[args.index("--redis") + 1] == "redis://shared:6379/0"

    run_async(scenario())


def test_a_lookalike_without_the_owner_uid_is_never_deleted(cluster, run_async) -> None:
    async def scenario() -> None:
        async with cluster() as (k, client, start_operator), start_operator():
            body = await create(client, "chat", BASE)
            await wait_for(lambda: observed(k, "chat") == 1, 15, "first reconcile")
            # Same name and labels as a prefill pool would have, owned by something else.
            lookalike = {
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "chat-prefill", "labels": {
                    "app.kubernetes.io/managed-by": "kvferry-operator", "kvferry.dev/service": "chat"},
                    "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "x",
                                         "uid": "someone-else"}]},
                "spec": {"ports": [{"port": 80}]},
            }
            await client.create(NS, lookalike)
            await change_spec(client, "chat", 2, {"router": {"replicas": 2}})
            await wait_for(lambda: observed(k, "chat") == 2, 15, "second reconcile")
            assert stored(k, "Service", "chat-prefill") is not None
            assert body["metadata"]["uid"] != "someone-else"

    run_async(scenario())


def test_a_removed_node_selector_is_gone_from_the_applied_deployment(cluster, run_async) -> None:
    async def scenario() -> None:
        async with cluster() as (k, client, start_operator), start_operator():
            await create(client, "chat", {**BASE, "pools": {"decode": {"nodeSelector": {"gpu": "a100"}}}})
            await wait_for(lambda: observed(k, "chat") == 1, 15, "first reconcile")
            old_hash = stored(k, "Deployment", "chat-decode")["metadata"]["annotations"][APPLIED_ANNOTATION]
            before = len(k.served)
            await change_spec(client, "chat", 2, {"pools": {"decode": {"nodeSelector": None}}})
            await wait_for(lambda: observed(k, "chat") == 2, 15, "second reconcile")
            (sent,) = [w for w in operator_writes(k, before) if w.path.endswith("/deployments/chat-decode")]
            assert (sent.method, sent.content_type) == ("PATCH", APPLY_CONTENT_TYPE)
            assert sent.params == {"fieldManager": FIELD_MANAGER, "force": "true"}
            assert "nodeSelector" not in sent.body["spec"]["template"]["spec"]
            # The hash is what tells the operator the Deployment differs, although every field
            # it still renders is already in place.
            assert sent.body["metadata"]["annotations"][APPLIED_ANNOTATION] != old_hash

    run_async(scenario())


def test_a_routing_change_rolls_the_pods_by_checksum(cluster, run_async) -> None:
    async def scenario() -> None:
        async with cluster() as (k, client, start_operator), start_operator():
            await create(client, "chat", BASE)
            await wait_for(lambda: observed(k, "chat") == 1, 15, "first reconcile")

            def checksums() -> dict[str, str]:
                return {name: stored(k, "Deployment", name)["spec"]["template"]["metadata"]["annotations"][
                    CONFIG_CHECKSUM_ANNOTATION] for name in ("chat-decode", "chat-router")}

            first = checksums()
            await change_spec(client, "chat", 2, {"router": {"routing": {"decode": "prefix-aware"}}})
            await wait_for(lambda: observed(k, "chat") == 2, 15, "second reconcile")
            assert stored(k, "ConfigMap", "chat-config")["data"]["KVFERRY_ROUTING_DECODE"] == "prefix-aware"
            second = checksums()
            assert first["chat-decode"] == first["chat-router"] != second["chat-decode"] == second["chat-router"]

    run_async(scenario())


HAND_EDITS = [
    ("Service", "chat-decode", {"spec": {"ports": [{"name": "http", "port": 9999}]}},
     lambda o: [p["port"] for p in o["spec"]["ports"]] == [8000, 5600]),
    ("ConfigMap", "chat-config", {"data": {"KVFERRY_KV_FAILURE_POLICY": "fail"}},
     lambda o: o["data"]["KVFERRY_KV_FAILURE_POLICY"] == "recompute"),
    ("HorizontalPodAutoscaler", "chat-decode", {"spec": {"maxReplicas": 40}},
     lambda o: o["spec"]["maxReplicas"] == 4),
    ("PodDisruptionBudget", "chat-decode", {"spec": {"maxUnavailable": 3}},
     lambda o: o["spec"]["maxUnavailable"] == 1),
    ("Ingress", "chat-router", {"spec": {"rules": [{"host": "other.example.com"}]}},
     lambda o: o["spec"]["rules"][0]["host"] == "llm.example.com"),
]


def test_children_changed_by_hand_are_put_back(cluster, run_async) -> None:
    async def scenario() -> None:
        async with cluster() as (k, client, start_operator), start_operator():
            spec = {**BASE, "pools": {"decode": {"autoscaling": {"maxReplicas": 4}}},
                    "ingress": {"host": "llm.example.com"}}
            await create(client, "chat", spec)
            await wait_for(lambda: observed(k, "chat") == 1, 15, "first reconcile")
            for kind, name, edit, is_restored in HAND_EDITS:
                before = len(k.served)
                await client._call("PATCH", object_path(kind, NS, name), edit, "application/merge-patch+json")
                await wait_for(lambda: is_restored(stored(k, kind, name)), 15, f"{kind}/{name} put back")
                (sent,) = [w for w in operator_writes(k, before) if "/inferenceservices/" not in w.path]
                assert (sent.path, sent.params["force"]) == (object_path(kind, NS, name), "true")

    run_async(scenario())


def test_host_path_sources_need_the_operator_to_allow_them(cluster, run_async) -> None:
    async def scenario() -> None:
        async with cluster() as (k, client, start_operator):
            spec = {**BASE, "model": {"source": "hostpath:///mnt/models/llama"}}
            async with start_operator():
                await create(client, "local", spec)
                await wait_for(lambda: condition(k, "local", "Degraded").get("status") == "True", 15, "Degraded")
                degraded = condition(k, "local", "Degraded")
                assert degraded["reason"] == "HostPathNotAllowed"
                assert "spec.model.source" in degraded["message"]
                assert "--set operator.allowHostPath=true" in degraded["message"]
                assert stored(k, "Deployment", "local-decode") is None
            async with start_operator("--allow-host-path"):
                deployment = await wait_for(lambda: stored(k, "Deployment", "local-decode"), 15, "the pool")
                (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "model"]
                assert volume["hostPath"] == {"path": "/mnt/models/llama", "type": "Directory"}
                await wait_for(lambda: condition(k, "local", "Degraded").get("status") == "False", 15,
                               "no longer Degraded")

    run_async(scenario())


async def annotate(client: Any, name: str, annotations: dict[str, str]) -> None:
    await client._call("PATCH", object_path("InferenceService", NS, name),
                       {"metadata": {"annotations": annotations}}, "application/merge-patch+json")


def engine_template(k: Any, deployment: str) -> dict[str, Any]:
    return stored(k, "Deployment", deployment)["spec"]["template"]


def test_the_kv_transfer_key_is_made_once_kept_and_replaced_only_on_request(
        cluster, run_async) -> None:
    async def scenario() -> None:
        async with cluster() as (k, client, start_operator), start_operator():
            body = await create(client, "chat", {**BASE, "pools": {"prefill": {}, "decode": {}}})
            await wait_for(lambda: observed(k, "chat") == 1, 15, "first reconcile")
            first = stored(k, "Secret", "chat-kv-transfer-key")
            (owner,) = first["metadata"]["ownerReferences"]
            assert (owner["kind"], owner["uid"]) == ("InferenceService", body["metadata"]["uid"])
            for pool in ("chat-prefill", "chat-decode"):
                env = engine_template(k, pool)["spec"]["containers"][0]["env"]
                assert {"name": "KVFERRY_KV_TRANSFER_KEY", "valueFrom": {"secretKeyRef": {
                    "name": "chat-kv-transfer-key", "key": "key"}}} in env
            # A spec change (and the reconciles it causes) keeps the key.
            await change_spec(client, "chat", 2, {"router": {"replicas": 2}})
            await wait_for(lambda: observed(k, "chat") == 2, 15, "second reconcile")
            kept = stored(k, "Secret", "chat-kv-transfer-key")
            assert (kept["metadata"]["uid"], kept["data"]) == (first["metadata"]["uid"],
                                                               first["data"])
            # Asked for: a new key, and pods that roll onto it.
            await annotate(client, "chat", {"rotation.kvferry.dev/kv-transfer-key": "2026-11-26"})
            await wait_for(lambda: (stored(k, "Secret", "chat-kv-transfer-key") or {}).get(
                "data") not in (None, first["data"]), 15, "the key replaced")
            rotated = stored(k, "Secret", "chat-kv-transfer-key")
            assert rotated["metadata"]["annotations"]["kvferry.dev/generated-for"] == "2026-11-26"
            await wait_for(lambda: engine_template(k, "chat-decode")["metadata"]["annotations"].get(
                "rotation.kvferry.dev/kv-transfer-key") == "2026-11-26", 15, "the pods rolled")
            # And kept again after that.
            await change_spec(client, "chat", 3, {"router": {"replicas": 1}})
            await wait_for(lambda: observed(k, "chat") == 3, 15, "third reconcile")
            assert stored(k, "Secret", "chat-kv-transfer-key")["data"] == rotated["data"]

    run_async(scenario())
