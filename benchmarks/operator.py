"""Operator throughput: seconds per InferenceService from create to children + status.

Runs the real operator process (`kvferry operator`) against kmock's in-memory API server,
creates N = 1, 10, 100 InferenceServices at once (each in a fresh emulator and operator),
and times until every child exists and every status has been written. Then it restarts the
operator, which reconciles every service once more with nothing changed, and counts the
writes it sends: writes per idle reconcile (the target is 0). The last line printed is one
JSON object with the figures.

    python benchmarks/operator.py [--sizes 1 10 100]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import kmock

from kvferry.operator import KIND
from kvferry.operator.kube import RESOURCES, USER_AGENT
from kvferry.operator.render import render_children
from kvferry.operator.spec import parse_spec

# The API emulator wrapper is test tooling (tests/support), not part of the operator package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from kvferry_testing.kube_emulator import (
    OperatorProcess,
    emulated_cluster,
    new_service,
    operator_requests,
    operator_writes,
    wait_for,
    write_kubeconfig,
)

SPEC = {"model": {"source": "demo"},
        "pools": {"prefill": {}, "decode": {"autoscaling": {"maxReplicas": 4}}}}
TARGET_SECONDS_PER_OBJECT = 0.2
TARGET_WRITES_PER_IDLE_RECONCILE = 0
RESUMED = "Resuming is processed"  # kopf's log line when a service's resume reconcile ends
# Short, so that noticing the end adds little to the time of one object; a poll is cheap.
POLL_SECONDS = 0.005

ObjectKey = tuple[Any, str, str]  # (kmock resource, namespace, name), as kmock keys objects


def _object_key(kind: str, name: str, namespace: str = "default") -> ObjectKey:
    api_version, plural = RESOURCES[kind]
    return kmock.resource(f"{api_version}/{plural}"), namespace, name


def _expected(bodies: list[dict[str, Any]]) -> list[tuple[ObjectKey, bool]]:
    """(key, needs a status) of every object that must exist: each service, then its children."""
    expected = []
    for body in bodies:
        expected.append((_object_key(KIND, body["metadata"]["name"]), True))
        expected += [(_object_key(c.kind, c.name), False) for c in render_children(parse_spec(body))]
    return expected


def _is_done(k: Any, key: ObjectKey, needs_status: bool) -> bool:
    """The object exists (and has conditions in its status when `needs_status`)."""
    if key not in k.objects or k.objects[key].deleted:
        return False
    return not needs_status or bool((k.objects[key].get("status") or {}).get("conditions"))


class Completion:
    """Which expected objects are still missing, checked without rescanning the others.

    Each poll walks the pending objects in order and stops at the first one still missing,
    so a poll costs what it finds plus one lookup, however many objects exist. Once none is
    pending, `verify()` checks every object once more, in case one vanished since it was seen.
    """

    def __init__(self, k: Any, expected: list[tuple[ObjectKey, bool]]) -> None:
        self.k = k
        self.expected = expected
        self.pending = collections.deque(expected)

    def poll(self) -> bool:
        """True when every expected object has been seen in its finished state."""
        while self.pending and _is_done(self.k, *self.pending[0]):
            self.pending.popleft()
        return not self.pending

    def verify(self) -> bool:
        """Every expected object is in its finished state now (one full pass)."""
        return all(_is_done(self.k, key, needs_status) for key, needs_status in self.expected)


async def measure(n: int, workdir: Path) -> dict[str, Any]:
    """Seconds from the first create to all children and statuses of `n` services."""
    async with emulated_cluster() as (k, client):
        kubeconfig = write_kubeconfig(workdir / f"kubeconfig-{n}", str(k.url))
        async with OperatorProcess(kubeconfig, workdir / f"operator-{n}.log"):
            # Let the operator finish starting (discovery, watches) before the clock starts.
            await wait_for(lambda: sum("watch=true" in str(r.url) for r in k.served) >= 7, 60,
                           "the operator's watch streams")
            bodies = [new_service(f"bench-{i:03d}", SPEC) for i in range(n)]
            completion = Completion(k, _expected(bodies))
            started = time.perf_counter()
            await asyncio.gather(*(client.create("default", b) for b in bodies))
            await wait_for(completion.poll, max(60.0, 2.0 * n), f"{n} services to settle",
                           interval=POLL_SECONDS)
            elapsed = time.perf_counter() - started
            if not completion.verify():
                raise RuntimeError(f"an object of the {n} services vanished after it was seen")
        requests = len(k.served)
        idle = await idle_reconciles(k, kubeconfig, workdir / f"operator-{n}-restart.log", n)
    return {"n": n, "seconds": elapsed, "seconds_per_object": elapsed / n,
            "children": len(completion.expected) - n, "requests": requests, **idle}


async def idle_reconciles(k: Any, kubeconfig: Path, log: Path, n: int) -> dict[str, float]:
    """Restart the operator over `n` settled services; what one reconcile of each sends."""
    before = len(k.served)
    async with OperatorProcess(kubeconfig, log):
        await wait_for(lambda: log.exists() and log.read_text().count(RESUMED) >= n, max(60.0, 1.0 * n),
                       f"the restarted operator to reconcile {n} services")
    # Reads by the operator's own client: kopf's discovery and watch streams are not per service.
    reads = [r for r in operator_requests(k, before) if r.method == "GET" and r.user_agent == USER_AGENT]
    return {"writes_per_idle_reconcile": len(operator_writes(k, before)) / n,
            "reads_per_idle_reconcile": len(reads) / n}


async def main(sizes: list[int]) -> dict[str, Any]:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            result = await measure(n, Path(tmp))
            results[n] = result
            print(f"N={n:4d}: {result['seconds']:.2f} s total, {result['seconds_per_object']:.3f} s per object "
                  f"({result['children']} children, {result['requests']} API requests); after a restart, "
                  f"{result['writes_per_idle_reconcile']:g} writes and "
                  f"{result['reads_per_idle_reconcile']:g} reads per idle reconcile", flush=True)
    per_object = {str(n): round(r["seconds_per_object"], 4) for n, r in results.items()}
    idle_writes = {str(n): r["writes_per_idle_reconcile"] for n, r in results.items()}
    return {
        "seconds_per_object": per_object,
        "seconds_total": {str(n): round(r["seconds"], 3) for n, r in results.items()},
        "writes_per_idle_reconcile": idle_writes,
        "reads_per_idle_reconcile": {str(n): r["reads_per_idle_reconcile"] for n, r in results.items()},
        "target_seconds_per_object": TARGET_SECONDS_PER_OBJECT,
        "target_writes_per_idle_reconcile": TARGET_WRITES_PER_IDLE_RECONCILE,
        "meets_target": (all(v < TARGET_SECONDS_PER_OBJECT for v in per_object.values())
                         and all(v <= TARGET_WRITES_PER_IDLE_RECONCILE for v in idle_writes.values())),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 10, 100])
    summary = asyncio.run(main(parser.parse_args().sizes))
    print(json.dumps(summary))
