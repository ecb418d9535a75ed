"""Operator throughput: seconds per InferenceService from create to children + status.

Runs the real operator process (`kvferry operator`) against kmock's in-memory API server,
creates N = 1, 10, 100 InferenceServices at once (each in a fresh emulator and operator),
and times until every child exists and every status has been written. The last line
printed is one JSON object with the figures.

    python benchmarks/operator.py [--sizes 1 10 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from kvferry.operator.emulator import (
    OperatorProcess,
    emulated_cluster,
    new_service,
    wait_for,
    write_kubeconfig,
)
from kvferry.operator.render import render_children
from kvferry.operator.spec import parse_spec

SPEC = {"model": {"source": "demo"},
        "pools": {"prefill": {}, "decode": {"autoscaling": {"maxReplicas": 4}}}}
TARGET_SECONDS_PER_OBJECT = 0.2


def _expected_children(k: Any, bodies: list[dict[str, Any]]) -> set[tuple[str, str]]:
    plural = {"ConfigMap": "configmaps", "Secret": "secrets", "Service": "services",
              "Deployment": "deployments", "PodDisruptionBudget": "poddisruptionbudgets",
              "HorizontalPodAutoscaler": "horizontalpodautoscalers", "Ingress": "ingresses"}
    return {(plural[c.kind], c.name) for b in bodies for c in render_children(parse_spec(b))}


def _progress(k: Any, expected: set[tuple[str, str]], names: set[str]) -> tuple[int, int]:
    """(children that exist, services whose status was written), read from emulator memory."""
    present, with_status = set(), 0
    for (resource, _, name), obj in list(k.objects.items()):
        if obj.deleted:
            continue
        if resource.plural == "inferenceservices":
            with_status += name in names and bool((obj.get("status") or {}).get("conditions"))
        elif (resource.plural, name) in expected:
            present.add((resource.plural, name))
    return len(present), with_status


async def measure(n: int, workdir: Path) -> dict[str, Any]:
    """Seconds from the first create to all children and statuses of `n` services."""
    async with emulated_cluster() as (k, client):
        kubeconfig = write_kubeconfig(workdir / f"kubeconfig-{n}", str(k.url))
        async with OperatorProcess(kubeconfig, workdir / f"operator-{n}.log"):
            # Let the operator finish starting (discovery, watches) before the clock starts.
            await wait_for(lambda: sum("watch=true" in str(r.url) for r in k.served) >= 7, 60,
                           "the operator's watch streams")
            bodies = [new_service(f"bench-{i:03d}", SPEC) for i in range(n)]
            expected, names = _expected_children(k, bodies), {b["metadata"]["name"] for b in bodies}
            started = time.perf_counter()
            await asyncio.gather(*(client.create("default", b) for b in bodies))
            await wait_for(lambda: _progress(k, expected, names) == (len(expected), n),
                           max(60.0, 2.0 * n), f"{n} services to settle", interval=0.05)
            elapsed = time.perf_counter() - started
    return {"n": n, "seconds": elapsed, "seconds_per_object": elapsed / n,
            "children": len(expected), "requests": len(k.served)}


async def main(sizes: list[int]) -> dict[str, Any]:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            result = await measure(n, Path(tmp))
            results[n] = result
            print(f"N={n:4d}: {result['seconds']:.2f} s total, {result['seconds_per_object']:.3f} s per object "
                  f"({result['children']} children, {result['requests']} API requests)", flush=True)
    per_object = {str(n): round(r["seconds_per_object"], 4) for n, r in results.items()}
    return {
        "seconds_per_object": per_object,
        "seconds_total": {str(n): round(r["seconds"], 3) for n, r in results.items()},
        "target_seconds_per_object": TARGET_SECONDS_PER_OBJECT,
        "meets_target": all(v < TARGET_SECONDS_PER_OBJECT for v in per_object.values()),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 10, 100])
    summary = asyncio.run(main(parser.parse_args().sizes))
    print(json.dumps(summary))
