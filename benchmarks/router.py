"""The router's own cost: the router in front of fake engine pods that answer at once,
against the same load sent to a fake pod directly, in the same run.

For 1, 64 and 512 concurrent streams (streamed completions, read to the end) it prints
requests/s and p50/p99 latency of both paths and the latency the router adds. The last
line is JSON; `ratio` is the router's requests/s over the direct path's at 64 streams.

    python benchmarks/router.py [--seconds 5] [--pods 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "router"))
from procs import Proc, fake_engine, redis_server, router_process  # noqa: E402

BODY = {"model": "fake", "prompt": "Hello", "max_tokens": 3, "stream": True}
SERVICE = "bench"


async def one_request(session: aiohttp.ClientSession, url: str) -> float:
    started = time.perf_counter()
    async with session.post(url, json=BODY) as response:
        assert response.status == 200, await response.text()
        async for _ in response.content.iter_any():
            pass
    return time.perf_counter() - started


async def load(url: str, concurrency: int, seconds: float) -> dict[str, float]:
    """`concurrency` streams back to back for `seconds`; latency percentiles in ms."""
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(min(concurrency, 8)):  # warm connections and code paths
            await one_request(session, url)

        async def stream() -> None:
            while time.perf_counter() < deadline:
                latencies.append(await one_request(session, url))

        started = time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    latencies.sort()
    return {"rps": len(latencies) / elapsed,
            "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]}


def run_load(url: str, concurrency: int, seconds: float) -> dict[str, float]:
    """In a fresh process, so the client's own event loop is the only thing it runs."""
    code = (f"import asyncio, json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import router as b; print(json.dumps(asyncio.run(b.load({url!r}, {concurrency}, "
            f"{seconds}))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--pods", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name, redis_server(Path(tmp_name)) as redis_url:
        tmp = Path(tmp_name)
        pods = [fake_engine(tmp, redis_url, SERVICE, "both", f"pod-{i}") for i in range(args.pods)]
        router = router_process(tmp, redis_url, SERVICE)
        try:
            time.sleep(1.0)  # the router's first registry reads
            results = measure(pods[0].port, router.port, args.seconds)  # type: ignore[attr-defined]
        finally:
            for proc in [router, *pods]:
                proc.stop()
    print(json.dumps(results))


def measure(direct_port: int, router_port: int, seconds: float) -> dict[str, object]:
    rows = {}
    print(f"{'streams':>8} {'direct rps':>11} {'router rps':>11} {'direct p50':>11} "
          f"{'router p50':>11} {'added p50':>10} {'added p99':>10}  (ms)")
    for concurrency in (1, 64, 512):
        direct = run_load(f"http://127.0.0.1:{direct_port}/v1/completions", concurrency, seconds)
        routed = run_load(f"http://127.0.0.1:{router_port}/v1/completions", concurrency, seconds)
        row = {"direct": direct, "router": routed,
               "added_p50_ms": routed["p50_ms"] - direct["p50_ms"],
               "added_p99_ms": routed["p99_ms"] - direct["p99_ms"]}
        rows[str(concurrency)] = row
        print(f"{concurrency:>8} {direct['rps']:>11.0f} {routed['rps']:>11.0f} "
              f"{direct['p50_ms']:>11.3f} {routed['p50_ms']:>11.3f} {row['added_p50_ms']:>10.3f} "
              f"{row['added_p99_ms']:>10.3f}", flush=True)
    return {"benchmark": "router", "cpus": os.cpu_count(),
            "ratio": rows["64"]["router"]["rps"] / rows["64"]["direct"]["rps"],
            "router_rps_max": max(r["router"]["rps"] for r in rows.values()),
            "added_p50_ms_1_stream": rows["1"]["added_p50_ms"], "by_streams": rows}


if __name__ == "__main__":
    main()
