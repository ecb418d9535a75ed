"""Status derivation and the subset comparison that keeps reconcile idempotent."""

from __future__ import annotations

from kvferry.operator.children import is_subset
from kvferry.operator.status import Problem, build_status, component_state, status_patch

NOW, LATER = "2030-01-01T00:00:00Z", "2030-01-01T00:05:00Z"


def deployment(replicas: int, ready: int, generation: int = 1, observed: int = 1,
               conditions: list[dict[str, str]] | None = None) -> dict:
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": observed, "replicas": replicas, "readyReplicas": ready,
                       "updatedReplicas": ready, "conditions": conditions or []}}


def conditions(status: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_ready_when_every_component_is_ready() -> None:
    states = [component_state("decode", deployment(2, 2)), component_state("router", deployment(1, 1))]
    status = build_status(states, [], "http://x", 3, None, NOW)
    assert status["observedGeneration"] == 3
    assert status["pools"] == {"decode": {"replicas": 2, "readyReplicas": 2, "summary": "2/2"}}
    assert conditions(status) == {"Ready": ("True", "AllReplicasReady"), "Progressing": ("False", "Stable"),
                                  "Degraded": ("False", "AsExpected")}


def test_not_ready_names_the_waiting_components() -> None:
    states = [component_state("decode", deployment(2, 1)), component_state("router", None)]
    status = build_status(states, [], "http://x", 1, None, NOW)
    ready = status["conditions"][0]
    assert (ready["status"], ready["message"]) == ("False", "waiting for decode 1/2, router 0/1")
    assert conditions(status)["Progressing"] == ("True", "RollingOut")


def test_degraded_by_problem_or_failing_deployment() -> None:
    failing = deployment(1, 0, conditions=[{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                                            "message": "quota exceeded"}])
    status = build_status([component_state("decode", failing)], [], "u", 1, None, NOW)
    degraded = status["conditions"][2]
    assert (degraded["status"], degraded["message"]) == ("True", "decode: FailedCreate: quota exceeded")
    problem = Problem("SecretNotFound", "spec.engine.imagePullSecrets[0]: Secret 'x' does not exist")
    status = build_status([component_state("decode", deployment(1, 1))], [problem], "u", 1, None, NOW)
    assert conditions(status)["Degraded"] == ("True", "SecretNotFound")
    assert conditions(status)["Ready"] == ("False", "SecretNotFound")


def test_transition_time_moves_only_on_status_change() -> None:
    first = build_status([component_state("decode", deployment(1, 0))], [], "u", 1, None, NOW)
    same = build_status([component_state("decode", deployment(1, 0))], [], "u", 1, first, LATER)
    assert same == first and status_patch(first, same) is None
    ready = build_status([component_state("decode", deployment(1, 1))], [], "u", 1, first, LATER)
    times = {c["type"]: c["lastTransitionTime"] for c in ready["conditions"]}
    assert times == {"Ready": LATER, "Progressing": LATER, "Degraded": NOW}


def test_status_patch_nulls_removed_pools() -> None:
    old = build_status([component_state("prefill", deployment(1, 1)), component_state("decode", deployment(1, 1))],
                       [], "u", 1, None, NOW)
    new = build_status([component_state("decode", deployment(1, 1))], [], "u", 2, old, NOW)
    patch = status_patch(old, new)
    assert patch is not None and patch["pools"]["prefill"] is None and patch["observedGeneration"] == 2


def test_stale_generation_is_progressing() -> None:
    state = component_state("decode", deployment(1, 1, generation=2, observed=1))
    assert not state.is_current
    status = build_status([state], [], "u", 1, None, NOW)
    assert conditions(status)["Progressing"] == ("True", "RollingOut")


def test_is_subset_ignores_server_fields_and_string_quantities() -> None:
    desired = {"spec": {"replicas": 2, "ports": [{"port": 8000}], "limits": {"nvidia.com/gpu": 1}}}
    live = {"metadata": {"resourceVersion": "7"},
            "spec": {"replicas": 2, "ports": [{"port": 8000, "protocol": "TCP"}], "limits": {"nvidia.com/gpu": "1"}}}
    assert is_subset(desired, live)
    assert not is_subset({"spec": {"replicas": 3}}, live)
    assert not is_subset({"spec": {"ports": [{"port": 8000}, {"port": 5600}]}}, live)
    assert not is_subset({"spec": {"enabled": True}}, {"spec": {"enabled": "True"}})



def test_a_pool_scaled_to_zero_is_ready_at_zero_of_zero() -> None:
    states = [component_state("prefill", deployment(0, 0)), component_state("decode", deployment(1, 1))]
    status = build_status(states, [], "u", 1, None, NOW)
    assert status["pools"]["prefill"] == {"replicas": 0, "readyReplicas": 0, "summary": "0/0"}
    assert conditions(status)["Ready"] == ("True", "AllReplicasReady")
    assert conditions(status)["Progressing"] == ("False", "Stable")
