"""Which children get applied or deleted, and when replicas are handed to an HPA."""

from __future__ import annotations

import copy
from typing import Any

from kvferry.operator.children import (
    APPLIED_ANNOTATION,
    applied_hash,
    is_owned,
    manager_owns,
    needs_apply,
    needs_replicas_handover,
    replicas_handover,
    stale_children,
    with_applied_hash,
)
from kvferry.operator.kube import FIELD_MANAGER

UID = "0f7c6c1e-uid-of-chat"
LABELS = {"app.kubernetes.io/managed-by": "kvferry-operator", "kvferry.dev/service": "chat"}


def child(kind: str, name: str, labels: dict[str, str] | None = None, owner: str | None = UID,
          **spec: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": f"uid-{kind}-{name}", "labels": LABELS if labels is None else labels}
    if owner is not None:
        meta["ownerReferences"] = [{"apiVersion": "kvferry.dev/v1alpha1", "kind": "InferenceService",
                                    "name": "chat", "uid": owner, "controller": True}]
    return {"apiVersion": "v1", "kind": kind, "metadata": meta, "spec": spec}


# What a real API server reports for a Deployment the operator applied with replicas, and
# whose status the controller writes.
MANAGED_FIELDS = [
    {"manager": "kvferry-operator", "operation": "Apply", "apiVersion": "apps/v1", "fieldsType": "FieldsV1",
     "time": "2030-01-01T00:00:00Z",
     "fieldsV1": {"f:metadata": {"f:annotations": {"f:kvferry.dev/applied": {}}, "f:labels": {"f:app": {}}},
                  "f:spec": {"f:replicas": {}, "f:selector": {}, "f:template": {"f:spec": {}}}}},
    {"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "apps/v1",
     "fieldsType": "FieldsV1", "subresource": "status", "time": "2030-01-01T00:00:05Z",
     "fieldsV1": {"f:status": {"f:replicas": {}, "f:readyReplicas": {}}}},
]


def deployment(replicas: int | None, managed_fields: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": "apps/v1", "kind": "Deployment",
                           "metadata": {"name": "chat-decode"}, "spec": {"selector": {}}}
    if replicas is not None:
        obj["spec"]["replicas"] = replicas
    if managed_fields is not None:
        obj["metadata"]["managedFields"] = managed_fields
    return obj


def test_applied_hash_ignores_its_own_annotation_and_sees_every_field() -> None:
    body = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}, "spec": {"ports": [{"port": 1}]}}
    stamped = with_applied_hash(body)
    assert stamped["metadata"]["annotations"] == {APPLIED_ANNOTATION: applied_hash(body)}
    assert applied_hash(stamped) == applied_hash(body)
    assert "annotations" not in body["metadata"]  # the input is not changed
    fewer = {**body, "spec": {}}
    assert applied_hash(fewer) != applied_hash(body)


def test_a_removed_field_needs_an_apply_although_the_rest_is_in_place() -> None:
    with_selector = deployment(2)
    with_selector["spec"]["template"] = {"spec": {"nodeSelector": {"gpu": "a100"}}}
    live = copy.deepcopy(with_hash := with_applied_hash(with_selector))
    live["status"] = {"replicas": 2}  # what the API server and controllers add is no reason
    assert not needs_apply(with_hash, live)
    without = with_applied_hash({**with_selector, "spec": {**with_selector["spec"], "template": {"spec": {}}}})
    without_hash = copy.deepcopy(without)
    del without_hash["metadata"]["annotations"]
    assert needs_apply(without, live)
    assert not needs_apply(without_hash, live)  # only the hash tells the difference
    assert needs_apply(with_hash, None)


def test_a_field_changed_by_hand_needs_an_apply() -> None:
    desired = with_applied_hash(deployment(2))
    live = copy.deepcopy(desired)
    live["spec"]["replicas"] = 7
    assert needs_apply(desired, live)


def test_ownership_needs_both_labels_and_the_owner_uid() -> None:
    assert is_owned(child("Service", "chat-prefill"), "chat", UID)
    assert not is_owned(child("Service", "chat-prefill", owner="another-uid"), "chat", UID)
    assert not is_owned(child("Service", "chat-prefill", owner=None), "chat", UID)
    assert not is_owned(child("Service", "chat-prefill", labels={}), "chat", UID)
    assert not is_owned(child("Service", "chat-prefill"), "other", UID)


def test_stale_children_are_the_owned_ones_the_spec_dropped_hpa_first() -> None:
    live = {
        ("ConfigMap", "chat-config"): child("ConfigMap", "chat-config"),
        ("Deployment", "chat-prefill"): child("Deployment", "chat-prefill"),
        ("Service", "chat-prefill"): child("Service", "chat-prefill"),
        ("PodDisruptionBudget", "chat-prefill"): child("PodDisruptionBudget", "chat-prefill"),
        ("HorizontalPodAutoscaler", "chat-prefill"): child("HorizontalPodAutoscaler", "chat-prefill"),
        ("HorizontalPodAutoscaler", "chat-decode"): child("HorizontalPodAutoscaler", "chat-decode"),
        ("Deployment", "chat-decode"): child("Deployment", "chat-decode"),
        ("Ingress", "chat-router"): child("Ingress", "chat-router", owner="someone-else"),
        ("Secret", "chat-redis-auth"): child("Secret", "chat-redis-auth"),
    }
    desired = [("ConfigMap", "chat-config"), ("Deployment", "chat-decode"), ("Secret", "chat-redis-auth")]
    assert stale_children(live, desired, "chat", UID) == [
        ("HorizontalPodAutoscaler", "chat-prefill"), ("HorizontalPodAutoscaler", "chat-decode"),
        ("Deployment", "chat-prefill"), ("Service", "chat-prefill"), ("PodDisruptionBudget", "chat-prefill"),
    ]
    # The ConfigMap is never pruned, even when it is not rendered.
    assert ("ConfigMap", "chat-config") not in stale_children(live, [], "chat", UID)


def test_manager_owns_reads_managed_fields() -> None:
    live = deployment(3, MANAGED_FIELDS)
    assert manager_owns(live, FIELD_MANAGER, ("spec", "replicas")) is True
    assert manager_owns(live, FIELD_MANAGER, ("spec", "paused")) is False
    assert manager_owns(live, "kube-controller-manager", ("status", "replicas")) is False  # an Update
    assert manager_owns(deployment(3), FIELD_MANAGER, ("spec", "replicas")) is None


def test_replicas_are_handed_over_only_while_the_operator_still_owns_them() -> None:
    autoscaled = deployment(None)
    assert needs_replicas_handover(autoscaled, deployment(3, MANAGED_FIELDS), FIELD_MANAGER)
    # The HPA has written the count already: the operator's entry no longer lists it.
    hpa_owned = copy.deepcopy(MANAGED_FIELDS)
    del hpa_owned[0]["fieldsV1"]["f:spec"]["f:replicas"]
    assert not needs_replicas_handover(autoscaled, deployment(5, hpa_owned), FIELD_MANAGER)
    # No managedFields reported: hand over, which is harmless when not needed.
    assert needs_replicas_handover(autoscaled, deployment(3), FIELD_MANAGER)
    assert not needs_replicas_handover(deployment(2), deployment(3, MANAGED_FIELDS), FIELD_MANAGER)
    assert not needs_replicas_handover(autoscaled, None, FIELD_MANAGER)
    assert replicas_handover(deployment(3, MANAGED_FIELDS)) == {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "chat-decode"},
        "spec": {"replicas": 3}}
