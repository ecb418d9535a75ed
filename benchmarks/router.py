"""The router's own cost: the router in front of fake engine pods that answer at once,
against the same load sent to a fake pod directly and, when it is installed (the `bench`
extra), through vllm-router (a Rust router) in front of the same pods, in the same run.

For 1, 64 and 512 concurrent streams (streamed completions, read to the end) it prints
requests/s and p50/p99 latency of each path and the latency each router adds. kvferry's
router runs twice: without a KV transfer key, and ("kvferry-keyed") with one shared with
its own twin pods, whose records and KV events it then verifies. The last line is JSON;
`ratio` is kvferry's requests/s over the direct path's at 64 streams,
`keyed_over_unkeyed` the keyed router's requests/s over the unkeyed one's, and
`ratio_vs_vllm_router` kvferry's requests/s over vllm-router's at each stream count.

    python benchmarks/router.py [--seconds 5] [--pods 2] [--streams 1 64 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from kvferry.kvtransfer.auth import KEY_ENV, generate_key_text
from kvferry_testing.procs import (
    Proc,
    fake_engine,
    free_port,
    redis_server,
    router_process,
    wait_http,
)

BODY = {"model": "fake", "prompt": "Hello", "max_tokens": 3, "stream": True}
SERVICE = "bench"
KEYED_SERVICE = "bench-keyed"


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


def vllm_router_binary() -> str | None:
    """vllm-router's launcher: beside this interpreter (a venv) or on PATH; None when absent."""
    beside = Path(sys.executable).parent / "vllm-router"
    return str(beside) if beside.exists() else shutil.which("vllm-router")


def vllm_router_process(binary: str, tmp: Path, pod_ports: list[int]) -> Proc:
    """vllm-router round-robining over the same pods; kvferry's own round-robin/least-loaded
    choice is about as cheap. Its 60 s health checks and queue never come into play."""
    port = free_port()
    workers = [f"http://127.0.0.1:{p}" for p in pod_ports]
    proc = Proc([binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
                 "--policy", "round_robin", "--log-level", "warning",
                 "--prometheus-port", str(free_port())], tmp / "vllm-router.log")
    proc.port = port  # type: ignore[attr-defined]
    wait_http(f"http://127.0.0.1:{port}/health", proc, 60)
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--pods", type=int, default=2)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 64, 512])
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds over every path; each figure is the rounds' median")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name, redis_server(Path(tmp_name)) as redis_url:
        tmp = Path(tmp_name)
        procs: list[Proc] = []
        try:
            pods = [fake_engine(tmp, redis_url, SERVICE, "both", f"pod-{i}")
                    for i in range(args.pods)]
            procs += pods
            router = router_process(tmp, redis_url, SERVICE)
            procs.append(router)
            # The same pods' twins and a router sharing a KV transfer key: records signed,
            # the router checking every record and KV event it reads.
            keyed_env = {KEY_ENV: generate_key_text()}
            keyed_pods = [fake_engine(tmp, redis_url, KEYED_SERVICE, "both", f"keyed-pod-{i}",
                                      env=keyed_env) for i in range(args.pods)]
            procs += keyed_pods
            keyed_router = router_process(tmp, redis_url, KEYED_SERVICE, env=keyed_env)
            procs.append(keyed_router)
            ports = {"direct": pods[0].port, "kvferry": router.port,  # type: ignore[attr-defined]
                     "kvferry-keyed": keyed_router.port}  # type: ignore[attr-defined]
            binary = vllm_router_binary()
            if binary is None:
                print("vllm-router is not installed (pip install 'kvferry[bench]'): "
                      "measuring without it")
            else:
                baseline = vllm_router_process(binary, tmp, [p.port for p in pods])  # type: ignore[attr-defined]
                procs.append(baseline)
                ports["vllm-router"] = baseline.port  # type: ignore[attr-defined]
            time.sleep(1.0)  # the router's first registry reads
            results = measure(ports, args.streams, args.seconds, args.repeats)
        finally:
            for proc in reversed(procs):
                proc.stop()
    print(json.dumps(results))


def measure(ports: dict[str, int], streams: list[int], seconds: float,
            repeats: int) -> dict[str, object]:
    """Each path in turn at each stream count, `repeats` rounds, medians of each figure;
    `ports` maps a path's name to its port, with "direct" the fake pod itself."""
    routers = [name for name in ports if name != "direct"]
    rows: dict[str, dict[str, Any]] = {}
    print(f"{'streams':>8} {'path':>12} {'rps':>8} {'p50':>8} {'p99':>8} {'added p50':>10} "
          f"{'added p99':>10}  (ms)")
    for concurrency in streams:
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in ports}
        for _ in range(repeats):  # paths interleaved, so a noisy moment hits them alike
            for name, port in ports.items():
                runs[name].append(run_load(f"http://127.0.0.1:{port}/v1/completions",
                                           concurrency, seconds))
        row: dict[str, Any] = {name: {k: statistics.median(r[k] for r in results)
                                      for k in results[0]} for name, results in runs.items()}
        direct = row["direct"]
        for name in routers:
            figures = row[name]
            figures["added_p50_ms"] = figures["p50_ms"] - direct["p50_ms"]
            figures["added_p99_ms"] = figures["p99_ms"] - direct["p99_ms"]
        for name in ports:
            f = row[name]
            added = (f"{f['added_p50_ms']:>10.3f} {f['added_p99_ms']:>10.3f}"
                     if name != "direct" else "")
            print(f"{concurrency:>8} {name:>12} {f['rps']:>8.0f} {f['p50_ms']:>8.3f} "
                  f"{f['p99_ms']:>8.3f} {added}", flush=True)
        row["keyed_over_unkeyed"] = row["kvferry-keyed"]["rps"] / row["kvferry"]["rps"]
        print(f"{concurrency:>8} kvferry keyed req/s / unkeyed req/s = "
              f"{row['keyed_over_unkeyed']:.3f}", flush=True)
        if "vllm-router" in row:
            row["kvferry_over_vllm_router"] = row["kvferry"]["rps"] / row["vllm-router"]["rps"]
            print(f"{concurrency:>8} kvferry req/s / vllm-router req/s = "
                  f"{row['kvferry_over_vllm_router']:.2f}", flush=True)
        rows[str(concurrency)] = row
    return summary(rows)


def summary(rows: dict[str, dict[str, Any]]) -> dict[str, object]:
    """The JSON line: headline figures first, every measurement under `by_streams`."""
    first = rows[next(iter(rows))]
    ratio_row = rows.get("64", first)
    out: dict[str, object] = {
        "benchmark": "router", "cpus": os.cpu_count(),
        "ratio": ratio_row["kvferry"]["rps"] / ratio_row["direct"]["rps"],
        "router_rps_max": max(r["kvferry"]["rps"] for r in rows.values()),
        "added_p50_ms_1_stream": rows["1"]["kvferry"]["added_p50_ms"] if "1" in rows else None,
        "keyed_over_unkeyed": {k: r["keyed_over_unkeyed"] for k, r in rows.items()},
    }
    if "kvferry_over_vllm_router" in first:
        out["ratio_vs_vllm_router"] = {k: r["kvferry_over_vllm_router"] for k, r in rows.items()}
        out["vllm_router_added_p50_ms_1_stream"] = (
            rows["1"]["vllm-router"]["added_p50_ms"] if "1" in rows else None)
    out["by_streams"] = rows
    return out


if __name__ == "__main__":
    main()
