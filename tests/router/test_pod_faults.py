"""A real engine pod killed under the router: later requests still succeed, and the
router stops choosing the pod once its registry key expires."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kvferry_testing.procs import Proc, free_port, router_process, wait_http

from kvferry.protocol.registry import REGISTRY_TTL_S

SERVICE = "faults"
FLAGS = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(16 * 1024 * 1024)]


def engine_pod(tmp: Path, redis_url: str, name: str) -> Proc:
    port = free_port()
    proc = Proc([sys.executable, "-m", "kvferry.cli", "serve", "--model", "demo",
                 "--port", str(port), "--redis", redis_url, "--service", SERVICE, *FLAGS],
                tmp / f"{name}.log", env={"KVFERRY_POD_NAME": name})
    proc.port = port  # type: ignore[attr-defined]
    wait_http(f"http://127.0.0.1:{port}/health", proc, 240)
    return proc


@pytest.fixture
def service(tmp_path: Path, redis_url: str) -> Iterator[dict[str, Proc]]:
    procs: dict[str, Proc] = {}
    try:
        procs["pod-a"] = engine_pod(tmp_path, redis_url, "pod-a")
        procs["pod-b"] = engine_pod(tmp_path, redis_url, "pod-b")
        procs["router"] = router_process(tmp_path, redis_url, SERVICE,
                                         env={"KVFERRY_ROUTING_DECODE": "round-robin"})
        yield procs
    finally:
        for proc in procs.values():
            proc.stop(signal.SIGKILL if proc.proc.poll() is None else signal.SIGTERM)


def complete(router: Proc) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{router.port}/v1/completions",  # type: ignore[attr-defined]
                      json={"model": "demo", "prompt": "Hello", "max_tokens": 4}, timeout=30)


def chosen(router: Proc) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{router.port}/metrics").text  # type: ignore[attr-defined]
    return {pod: float(n) for pod, n in re.findall(
        r'kvferry:router_pod_chosen_total\{pod="([^"]+)",policy="round-robin",pool="decode"\} '
        r'(\S+)', text)}


def test_killed_pod_is_retried_around_then_dropped(service: dict[str, Proc]) -> None:
    router = service["router"]
    deadline = time.monotonic() + 10
    while httpx.get(f"http://127.0.0.1:{router.port}/health").json()["pools"] != {  # type: ignore[attr-defined]
            "decode": ["pod-a", "pod-b"]}:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert [complete(router).status_code for _ in range(4)] == [200] * 4
    assert chosen(router) == {"pod-a": 2.0, "pod-b": 2.0}

    os.killpg(service["pod-a"].proc.pid, signal.SIGKILL)  # no goodbye: the key stays until its TTL
    service["pod-a"].proc.wait(10)
    killed_at = time.monotonic()
    assert [complete(router).status_code for _ in range(6)] == [200] * 6
    metrics = httpx.get(f"http://127.0.0.1:{router.port}/metrics").text  # type: ignore[attr-defined]
    assert 'kvferry:router_retries_total{hop="decode"} 1.0' in metrics

    while "pod-a" in httpx.get(f"http://127.0.0.1:{router.port}/health").json()["pools"]["decode"]:  # type: ignore[attr-defined]
        assert time.monotonic() - killed_at < REGISTRY_TTL_S + 2
        time.sleep(0.05)
    before = chosen(router)["pod-a"]
    assert [complete(router).status_code for _ in range(4)] == [200] * 4
    assert chosen(router)["pod-a"] == before


def test_an_engine_pod_registers_its_record_and_says_it_leaves_on_sigterm(
        tmp_path: Path, redis_url: str) -> None:
    import redis

    from kvferry.protocol.registry import PodRecord, pod_key_prefix

    pod = engine_pod(tmp_path, redis_url, "pod-c")
    key = pod_key_prefix(SERVICE) + "pod-c"
    store = redis.Redis.from_url(redis_url)
    try:
        record = PodRecord.from_json(store.get(key))
        assert (record.role, record.model, record.url, record.block_size) == (
            "both", "demo", f"http://127.0.0.1:{pod.port}", 16)  # type: ignore[attr-defined]
        assert (record.num_running, record.num_waiting, record.is_leaving) == (0, 0, False)
        assert 0 < store.pttl(key) <= REGISTRY_TTL_S * 1000
        pod.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 1.0  # well under the TTL: the pod says it leaves
        while not PodRecord.from_json(store.get(key)).is_leaving:
            assert time.monotonic() < deadline, pod.log()
            time.sleep(0.02)
        # Its last word: nothing refreshes the key after it, and it expires.
        assert pod.proc.wait(20) == 0
        deadline = time.monotonic() + REGISTRY_TTL_S + 1.0
        while store.exists(key):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        pod.stop()
