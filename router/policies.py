"""How the router picks one pod of a pool: round robin, least loaded, prefix-aware."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvferry.router.pods import Pod
from kvferry.router.prefix_index import PrefixIndex

# Prefix-aware scores a pod by the fraction of the prompt's blocks it holds (0 to 1) minus
# its load: each request queued in its engine and each request this router has in flight
# on it costs a share of a whole-prompt hit, so a hot prefix cannot pin all traffic on one
# pod. With these weights a pod holding the whole prompt stops winning against an idle pod
# at about 4 in-flight requests, or fewer when its engine reports a queue.
WAITING_WEIGHT = 0.3
IN_FLIGHT_WEIGHT = 0.25


@dataclass(frozen=True)
class Choice:
    """A pod picked for a request, and why."""

    pod: Pod
    # Prompt tokens the pod is predicted to hold in its prefix cache already.
    predicted_hit_tokens: int = 0


def load_key(pod: Pod) -> tuple[float, float, int]:
    """Least loaded first: waiting queue, then KV usage, then requests this router sent."""
    r = pod.record
    return (r.num_waiting + max(0, pod.num_routed - r.num_running - r.num_waiting),
            r.kv_cache_usage, pod.num_routed)


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, pods: list[Pod], hashes: list[bytes] | None) -> Choice:
        ordered = sorted(pods, key=lambda p: p.name)
        return Choice(ordered[next(self._counter) % len(ordered)])


class LeastLoaded:
    name = "least-loaded"

    def choose(self, pods: list[Pod], hashes: list[bytes] | None) -> Choice:
        return Choice(min(pods, key=lambda p: (load_key(p), p.name)))


class PrefixAware:
    """Largest share of leading prompt blocks held, minus a load penalty; ties go to the
    least loaded."""

    name = "prefix-aware"

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    def choose(self, pods: list[Pod], hashes: list[bytes] | None) -> Choice:
        if not hashes:
            return LeastLoaded().choose(pods, hashes)
        matched = self.index.num_leading_blocks(hashes, [p.name for p in pods])

        def score(pod: Pod) -> tuple[float, tuple[float, float, int], str]:
            penalty = (WAITING_WEIGHT * pod.record.num_waiting
                       + IN_FLIGHT_WEIGHT * pod.num_routed)
            return (-(matched[pod.name] / len(hashes) - penalty), load_key(pod), pod.name)

        best = min(pods, key=score)
        return Choice(best, matched[best.name] * best.record.block_size)


Policy = RoundRobin | LeastLoaded | PrefixAware


def make_policy(name: str, index: PrefixIndex) -> Policy:
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "prefix-aware":
        return PrefixAware(index)
    raise ValueError(f"unknown routing policy {name!r}")
