"""Derive an InferenceService's `status` from its children: pure functions, no client.

Conditions follow Kubernetes conventions: `Ready` (every component serves at its desired
size), `Progressing` (a rollout or scale-up is under way), `Degraded` (something needs a
human: a missing Secret, a Deployment that cannot create pods or missed its deadline).
`lastTransitionTime` moves only when a condition's status changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvferry.operator.spec import POOL_NAMES


@dataclass(frozen=True)
class ComponentState:
    """What one child Deployment reports."""

    component: str  # encoder | prefill | decode | router | redis
    desired: int  # spec.replicas (the HPA's choice when it autoscales)
    ready: int  # status.readyReplicas
    updated: int  # status.updatedReplicas
    is_current: bool  # the Deployment controller has seen the latest spec
    failure: str | None  # why it cannot make progress, if it cannot


@dataclass(frozen=True)
class Problem:
    """A spec problem the schema cannot catch (e.g. a Secret that does not exist)."""

    reason: str  # CamelCase, e.g. SecretNotFound
    message: str  # names the field, e.g. "spec.engine.imagePullSecrets[0]: Secret ..."


def component_state(component: str, deployment: dict[str, Any] | None) -> ComponentState:
    """Summarize a live Deployment (None: it does not exist yet)."""
    if deployment is None:
        return ComponentState(component, 1, 0, 0, False, None)
    spec, status = deployment.get("spec", {}), deployment.get("status") or {}
    generation = deployment.get("metadata", {}).get("generation")
    observed = status.get("observedGeneration")
    failure = None
    for cond in status.get("conditions", []):
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            failure = f"{cond.get('reason', 'ReplicaFailure')}: {cond.get('message', '')}".strip(": ")
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            failure = f"ProgressDeadlineExceeded: {cond.get('message', '')}".strip(": ")
    return ComponentState(
        component=component,
        desired=int(spec.get("replicas", status.get("replicas", 1))),
        ready=int(status.get("readyReplicas", 0)),
        updated=int(status.get("updatedReplicas", status.get("readyReplicas", 0))),
        is_current=generation is None or observed is None or observed >= generation,
        failure=failure,
    )


def _condition(kind: str, ok: bool, reason: str, message: str, previous: dict[str, dict[str, Any]],
               now: str, generation: int | None) -> dict[str, Any]:
    status = "True" if ok else "False"
    before = previous.get(kind, {})
    since = before.get("lastTransitionTime") if before.get("status") == status else None
    cond = {"type": kind, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": since or now}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def _ready(states: list[ComponentState]) -> tuple[bool, str, str]:
    # A component scaled to 0 is ready at 0/0: it has all the pods it was asked for.
    waiting = [s for s in states if s.ready < s.desired]
    if not waiting:
        return True, "AllReplicasReady", "every component is ready"
    detail = ", ".join(f"{s.component} {s.ready}/{s.desired}" for s in waiting)
    return False, "ReplicasNotReady", f"waiting for {detail}"


def _progressing(states: list[ComponentState]) -> tuple[bool, str, str]:
    moving = [s for s in states if not s.is_current or s.updated < s.desired or s.ready < s.desired]
    if moving:
        return True, "RollingOut", "rolling out " + ", ".join(s.component for s in moving)
    return False, "Stable", "no rollout in progress"


def _degraded(states: list[ComponentState], problems: list[Problem]) -> tuple[bool, str, str]:
    if problems:
        return True, problems[0].reason, "; ".join(p.message for p in problems)
    failing = [s for s in states if s.failure]
    if failing:
        return True, "ComponentFailing", "; ".join(f"{s.component}: {s.failure}" for s in failing)
    return False, "AsExpected", "no problem found"


def build_status(
    states: list[ComponentState],
    problems: list[Problem],
    url: str,
    generation: int | None,
    previous: dict[str, Any] | None,
    now: str,
) -> dict[str, Any]:
    """The full `status` of an InferenceService from its components' states.

    `previous` is the current status (for `lastTransitionTime`); `now` an RFC 3339 time.
    """
    prev = {c["type"]: c for c in (previous or {}).get("conditions", []) if "type" in c}
    pools = {
        s.component: {"replicas": s.desired, "readyReplicas": s.ready, "summary": f"{s.ready}/{s.desired}"}
        for s in states if s.component in POOL_NAMES
    }
    conditions = [
        _condition(kind, *verdict, prev, now, generation)
        for kind, verdict in (
            ("Ready", _ready(states) if not problems else (False, problems[0].reason, problems[0].message)),
            ("Progressing", _progressing(states)),
            ("Degraded", _degraded(states, problems)),
        )
    ]
    status: dict[str, Any] = {"url": url, "pools": pools, "conditions": conditions}
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def status_patch(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any] | None:
    """A merge patch turning `old` into `new` (pools that went away are nulled); None if equal."""
    old = old or {}
    fields = ("observedGeneration", "url", "pools", "conditions")
    if all(old.get(k) == new.get(k) for k in fields):
        return None
    patch = dict(new)
    gone = set(old.get("pools") or {}) - set(new["pools"])
    if gone:
        patch["pools"] = {**new["pools"], **{p: None for p in gone}}
    return patch
