"""Which children to write, which to delete, and how replicas are handed to an HPA: pure functions.

A child is written with server-side apply only when it differs from what the API server
holds. Two things make "differs" exact:

- every desired child carries `kvferry.dev/applied`, a hash of the whole body the operator
  applies, so a field the operator stops rendering (a removed nodeSelector) changes the
  hash and triggers an apply that drops the field;
- the rest is a subset comparison against the live object: fields the API server or other
  controllers add are ignored, fields changed by hand are noticed and put back.

A child is deleted only when it carries the operator's labels for this service *and* an
owner reference to this service's uid, so an object that merely has a matching name is
never touched.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from kvferry.operator.labels import MANAGED_BY, SERVICE_LABEL

APPLIED_ANNOTATION = "kvferry.dev/applied"
"""Child annotation: sha256 of the body the operator last applied (without this annotation)."""

GENERATED_FOR_ANNOTATION = "kvferry.dev/generated-for"
"""Annotation of a generated (create-only) child: what it was generated for. A create-only
child is never patched; one whose live value differs from the desired one is replaced
(deleted, then created anew), which is how a generated Secret is rotated on request."""

HANDOVER_MANAGER = "kvferry-handover-to-hpa"
"""Field manager that briefly co-owns a Deployment's replicas while an HPA takes them over."""

LISTED_KINDS = ("ConfigMap", "Service", "Deployment", "PodDisruptionBudget",
                "HorizontalPodAutoscaler", "Ingress", "NetworkPolicy")
"""Child kinds the operator lists (by label) to compare and prune; Secrets are only ever read
by name, so the operator needs no permission to list them."""

PRUNED_KINDS = frozenset({"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
                          "Ingress", "Secret", "NetworkPolicy"})
"""Child kinds a spec change can make unwanted (a removed pool, autoscaling, ingress, network
policies, or the managed Redis once an external one is named). The ConfigMap always exists."""

ChildKey = tuple[str, str]  # (kind, name)


def is_subset(desired: Any, live: Any) -> bool:
    """True when every field of `desired` has the same value in `live`.

    Fields the API server adds (defaults, status, resourceVersion) are ignored; lists must
    match item by item. Integers compare equal to their string form (`1` and `"1"`), as
    int-or-string quantities come back as strings.
    """
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and is_subset(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(live, list) and len(desired) == len(live)
                and all(is_subset(d, item) for d, item in zip(desired, live)))
    if isinstance(desired, int) and isinstance(live, str) and not isinstance(desired, bool):
        return str(desired) == live
    return bool(desired == live)


def applied_hash(manifest: dict[str, Any]) -> str:
    """sha256 of a manifest as it will be applied, leaving out its own hash annotation."""
    meta = dict(manifest.get("metadata", {}))
    annotations = {k: v for k, v in meta.get("annotations", {}).items() if k != APPLIED_ANNOTATION}
    meta.pop("annotations", None)
    if annotations:
        meta["annotations"] = annotations
    body = json.dumps({**manifest, "metadata": meta}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def with_applied_hash(manifest: dict[str, Any]) -> dict[str, Any]:
    """A copy of `manifest` annotated with its `applied_hash`."""
    meta = dict(manifest["metadata"])
    meta["annotations"] = {**meta.get("annotations", {}), APPLIED_ANNOTATION: applied_hash(manifest)}
    return {**manifest, "metadata": meta}


def generated_for(manifest: dict[str, Any]) -> str:
    """A generated child's GENERATED_FOR_ANNOTATION ("" when it has none)."""
    return str(((manifest.get("metadata") or {}).get("annotations") or {})
               .get(GENERATED_FOR_ANNOTATION, ""))


def needs_regeneration(desired: dict[str, Any], live: dict[str, Any] | None) -> bool:
    """True when a live create-only child was generated for something else than asked now."""
    return live is not None and generated_for(live) != generated_for(desired)


def needs_apply(desired: dict[str, Any], live: dict[str, Any] | None) -> bool:
    """True when the live child is missing or differs from the desired one (hash included)."""
    return live is None or not is_subset(desired, live)


def is_owned(obj: dict[str, Any], service: str, owner_uid: str) -> bool:
    """The object carries this operator's labels for `service` and is owned by its uid."""
    meta = obj.get("metadata", {})
    labels = meta.get("labels") or {}
    if labels.get("app.kubernetes.io/managed-by") != MANAGED_BY or labels.get(SERVICE_LABEL) != service:
        return False
    return any(ref.get("uid") == owner_uid for ref in meta.get("ownerReferences") or [])


def stale_children(live: dict[ChildKey, dict[str, Any]], desired: Iterable[ChildKey], service: str,
                   owner_uid: str) -> list[ChildKey]:
    """Live children of this service that the spec no longer asks for, in deletion order.

    HPAs come first, so a pool whose autoscaling is removed is not rescaled by its HPA
    after the operator hands the replica count back to the spec.
    """
    wanted = set(desired)
    stale = [key for key, obj in live.items()
             if key[0] in PRUNED_KINDS and key not in wanted and is_owned(obj, service, owner_uid)]
    return sorted(stale, key=lambda key: key[0] != "HorizontalPodAutoscaler")


def manager_owns(obj: dict[str, Any], manager: str, path: tuple[str, ...]) -> bool | None:
    """Whether `manager` applied the field at `path`, from the object's managedFields.

    None when the object carries no managedFields at all (an API server that does not
    report them): the caller cannot tell and must act safely either way.
    """
    entries = obj.get("metadata", {}).get("managedFields")
    if entries is None:
        return None
    for entry in entries:
        if entry.get("manager") != manager or entry.get("operation") != "Apply":
            continue
        node = entry.get("fieldsV1") or {}
        for part in path:
            node = node.get(f"f:{part}")
            if node is None:
                break
        else:
            return True
    return False


def needs_replicas_handover(desired: dict[str, Any], live: dict[str, Any] | None,
                            manager: str) -> bool:
    """True when applying `desired` would drop a replica count this operator still owns.

    Server-side apply removes a field its manager stops applying when no other manager owns
    it, and the Deployment's default of 1 replica takes its place. That is what would happen
    when autoscaling is switched on before the HPA has written the count.
    """
    if live is None or desired.get("kind") != "Deployment" or "replicas" in desired.get("spec", {}):
        return False
    if "replicas" not in (live.get("spec") or {}):
        return False
    return manager_owns(live, manager, ("spec", "replicas")) is not False


def replicas_handover(live: dict[str, Any]) -> dict[str, Any]:
    """The body that lets `HANDOVER_MANAGER` co-own the live replica count (applied without
    force: a conflict means the HPA owns it already, which is the goal anyway)."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": live["metadata"]["name"]},
        "spec": {"replicas": live["spec"]["replicas"]},
    }
