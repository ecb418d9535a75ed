"""Liveness under load, with real processes and a real Redis: a burst of a thousand requests
gets no 503 while every pod is alive, a pod whose record is late is routed to for the grace
period, a pod that refuses connections or says it leaves is dropped at once, and the router
opens no more than its cap of connections to one pod."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Self

import aiohttp
import httpx
import pytest
import redis
from kvferry_testing.procs import Proc, fake_engine, router_process

from kvferry.protocol.registry import REGISTRY_TTL_S, pod_key_prefix

BURST = 1000


def url(proc: Proc) -> str:
    return f"http://127.0.0.1:{proc.port}"  # type: ignore[attr-defined]


def metric(router: Proc, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(url(router) + "/metrics").text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample.split("{")[0] == name and all(f'{k}="{v}"' in sample
                                                  for k, v in labels.items()):
            total += float(value)
    return total


def pools(router: Proc) -> dict[str, list[str]]:
    return httpx.get(url(router) + "/health").json()["pools"]


def wait_pools(router: Proc, expected: dict[str, list[str]], timeout_s: float = 10.0) -> float:
    """Waits until the router lists `expected`; returns when (time.monotonic())."""
    deadline = time.monotonic() + timeout_s
    while (seen := pools(router)) != expected:
        assert time.monotonic() < deadline, f"pools {seen} != {expected}"
        time.sleep(0.02)
    return time.monotonic()


def complete(router: Proc) -> int:
    return httpx.post(url(router) + "/v1/completions", timeout=30,
                      json={"model": "fake", "prompt": "p", "max_tokens": 2}).status_code


def connections(pod: Proc) -> int:
    """Connections the pod has seen generation requests on, since it started."""
    return httpx.get(url(pod) + "/fake/connections").json()


def burst(router: Proc, num_waves: int = 1, wave_gap_s: float = 0.0) -> dict[object, int]:
    """BURST completions, each on a connection of its own, in `num_waves` waves
    `wave_gap_s` apart (all in flight together); how many got each status (or error)."""

    async def main() -> dict[object, int]:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=90)) as session:
            async def one(index: int) -> object:
                await asyncio.sleep(index % num_waves * wave_gap_s)
                try:
                    async with session.post(url(router) + "/v1/completions", json={
                            "model": "fake", "prompt": f"p{index}", "max_tokens": 2}) as r:
                        await r.read()
                        return r.status
                except (aiohttp.ClientError, TimeoutError) as exc:
                    return type(exc).__name__

            return dict(collections.Counter(await asyncio.gather(*map(one, range(BURST)))))

    return asyncio.run(main())


class PoolWatcher:
    """Reads the router's pools from /health every 0.1 s, in a thread, while in use."""

    def __init__(self, router: Proc) -> None:
        self._router = router
        self.seen: list[dict[str, list[str]]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch)

    def _watch(self) -> None:
        while not self._done.wait(0.1):
            self.seen.append(pools(self._router))

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join()


@pytest.fixture
def procs() -> Iterator[dict[str, Proc]]:
    started: dict[str, Proc] = {}
    try:
        yield started
    finally:
        for proc in started.values():
            if proc.proc.poll() is None:
                os.kill(proc.proc.pid, signal.SIGCONT)  # a stopped process cannot die
            proc.stop(signal.SIGKILL)


@pytest.fixture
def store(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def test_a_burst_of_1000_requests_gets_no_503_while_every_pod_is_alive(
        tmp_path: Path, redis_url: str, procs: dict[str, Proc]) -> None:
    """Each request holds its pod's event loop for 20 ms of Python work (parsing,
    tokenizing, detokenizing in a real pod), so a pod's loop is busy for seconds at a time:
    its registry record must not expire meanwhile, nor the router drop it."""
    for name in ("busy-0", "busy-1"):
        procs[name] = fake_engine(tmp_path, redis_url, "burst", "decode", name)
        httpx.post(url(procs[name]) + "/fake/loop", json={"work_ms": 20}).raise_for_status()
    procs["router"] = router = router_process(tmp_path, redis_url, "burst")
    wait_pools(router, {"decode": ["busy-0", "busy-1"]})

    # Ten waves of a hundred, 0.4 s apart: later waves arrive while the pods are busiest.
    with PoolWatcher(router) as watcher:
        statuses = burst(router, num_waves=10, wave_gap_s=0.4)

    assert statuses == {200: BURST}
    # Not one moment without a pod: every read of /health during the burst listed both.
    assert len(watcher.seen) > 20
    assert all(pools == {"decode": ["busy-0", "busy-1"]} for pools in watcher.seen), [
        pools for pools in watcher.seen if pools != {"decode": ["busy-0", "busy-1"]}][:3]
    assert metric(router, "kvferry:router_requests_total", status="200") == BURST
    assert metric(router, "kvferry:router_pods_dropped_total") == 0
    assert pools(router) == {"decode": ["busy-0", "busy-1"]}


def test_a_pod_whose_record_is_late_is_routed_to_for_the_grace_period_then_dropped_until_back(
        tmp_path: Path, redis_url: str, procs: dict[str, Proc], store: redis.Redis) -> None:
    grace_s = 2.0
    procs["pod"] = pod = fake_engine(tmp_path, redis_url, "grace", "decode", "late-0")
    procs["router"] = router = router_process(tmp_path, redis_url, "grace",
                                              "--pod-grace", str(grace_s))
    wait_pools(router, {"decode": ["late-0"]})
    key = pod_key_prefix("grace") + "late-0"

    os.kill(pod.proc.pid, signal.SIGSTOP)  # nothing refreshes its record now
    deadline = time.monotonic() + REGISTRY_TTL_S + 1.0
    while store.exists(key):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    expired_at = time.monotonic()
    # The router polls every 0.25 s: well within the grace period, the pod is still there.
    while time.monotonic() < expired_at + grace_s - 0.5:
        assert pools(router) == {"decode": ["late-0"]}
        time.sleep(0.05)
    assert metric(router, "kvferry:router_pods_late") == 1
    dropped_at = wait_pools(router, {}, timeout_s=grace_s + 1.0)
    assert dropped_at - expired_at >= grace_s - 0.1
    assert metric(router, "kvferry:router_pods_dropped_total", pool="decode",
                  reason="expired") == 1
    assert metric(router, "kvferry:router_pods_late") == 0

    os.kill(pod.proc.pid, signal.SIGCONT)  # its thread refreshes the record at once
    wait_pools(router, {"decode": ["late-0"]}, timeout_s=2.0)
    assert complete(router) == 200


def test_a_pod_that_refuses_connections_is_dropped_at_once_until_a_newer_record(
        tmp_path: Path, redis_url: str, procs: dict[str, Proc], store: redis.Redis) -> None:
    for name in ("gone-0", "kept-1"):
        procs[name] = fake_engine(tmp_path, redis_url, "refused", "decode", name)
    procs["router"] = router = router_process(
        tmp_path, redis_url, "refused", env={"KVFERRY_ROUTING_DECODE": "round-robin"})
    wait_pools(router, {"decode": ["gone-0", "kept-1"]})
    key = pod_key_prefix("refused") + "gone-0"

    procs["gone-0"].proc.kill()  # no goodbye: its record stays until it expires
    procs["gone-0"].proc.wait(10)
    killed_at = time.monotonic()
    # Round robin sends one of these to the dead pod: refused, retried, the pod dropped.
    assert [complete(router) for _ in range(4)] == [200] * 4
    assert pools(router) == {"decode": ["kept-1"]}
    assert metric(router, "kvferry:router_pods_dropped_total", pool="decode",
                  reason="refused") == 1
    assert metric(router, "kvferry:router_retries_total", hop="decode") == 1
    # Its record, reread at every poll while it lives on, does not bring it back.
    time.sleep(0.6)
    assert pools(router) == {"decode": ["kept-1"]}
    assert store.exists(key) and time.monotonic() - killed_at < REGISTRY_TTL_S

    # A new process under the same name publishes a newer record: it is routed to again.
    procs["gone-0 again"] = back = fake_engine(tmp_path, redis_url, "refused", "decode",
                                               "gone-0")
    wait_pools(router, {"decode": ["gone-0", "kept-1"]})
    assert [complete(router) for _ in range(4)] == [200] * 4
    assert connections(back) == 1


def test_a_pod_refused_on_a_relayed_endpoint_is_dropped_too(
        tmp_path: Path, redis_url: str, procs: dict[str, Proc]) -> None:
    procs["pod"] = fake_engine(tmp_path, redis_url, "relayed", "decode", "models-0")
    procs["router"] = router = router_process(tmp_path, redis_url, "relayed")
    wait_pools(router, {"decode": ["models-0"]})
    procs["pod"].proc.kill()
    procs["pod"].proc.wait(10)

    assert httpx.get(url(router) + "/v1/models").status_code == 502
    assert pools(router) == {}
    assert metric(router, "kvferry:router_pods_dropped_total", pool="decode",
                  reason="refused") == 1
    assert httpx.get(url(router) + "/v1/models").status_code == 503  # no pod left to ask


def test_a_pod_that_says_it_leaves_is_dropped_at_once(
        tmp_path: Path, redis_url: str, procs: dict[str, Proc], store: redis.Redis) -> None:
    for name in ("leaving-0", "staying-1"):
        procs[name] = fake_engine(tmp_path, redis_url, "leave", "decode", name)
    procs["router"] = router = router_process(tmp_path, redis_url, "leave")
    wait_pools(router, {"decode": ["leaving-0", "staying-1"]})

    stopped_at = time.monotonic()
    procs["leaving-0"].proc.send_signal(signal.SIGTERM)
    # Well before its record could expire and a grace period pass (3 + 5 s).
    assert wait_pools(router, {"decode": ["staying-1"]}, timeout_s=1.5) - stopped_at < 1.5
    assert metric(router, "kvferry:router_pods_dropped_total", pool="decode",
                  reason="left") == 1
    assert procs["leaving-0"].proc.wait(10) == 0


def test_1000_concurrent_requests_open_no_more_than_the_cap_of_connections_per_pod(
        tmp_path: Path, redis_url: str, procs: dict[str, Proc]) -> None:
    cap = 16
    for name in ("capped-0", "capped-1"):
        procs[name] = fake_engine(tmp_path, redis_url, "capped", "decode", name)
    procs["router"] = router = router_process(tmp_path, redis_url, "capped",
                                              "--max-pod-connections", str(cap))
    wait_pools(router, {"decode": ["capped-0", "capped-1"]})

    statuses = burst(router)

    assert statuses == {200: BURST}
    opened = [connections(procs[name]) for name in ("capped-0", "capped-1")]
    # The cap, and used: a thousand requests at once need every connection it allows.
    assert all(1 < n <= cap for n in opened), opened
    assert metric(router, "kvferry:router_hops_waiting_for_connection") == 0


def test_a_refused_pods_last_refresh_read_after_the_drop_does_not_bring_it_back(
        redis_url: str, store: redis.Redis) -> None:
    """The pod refreshed its record after the router's last read, then died: the record the
    router reads after the drop is newer than the one it dropped, yet still the dead pod's.
    Only a record written after that brings the pod back."""
    from kvferry.router.pods import PodDirectory

    from kvferry.protocol.registry import PodRecord

    key = pod_key_prefix("race") + "racy-0"

    def publish(updated_at: float) -> None:
        record = PodRecord(pod="racy-0", service="race", role="decode", model="m",
                           url="http://127.0.0.1:1", block_size=16, num_running=0,
                           num_waiting=0, kv_cache_usage=0.0, updated_at=updated_at)
        store.set(key, record.to_json(), px=int(REGISTRY_TTL_S * 1000))

    async def main() -> list[dict[str, list[str]]]:
        dropped: list[tuple[str, str]] = []
        pods = PodDirectory(redis_url, "race", 0.25,
                            on_drop=lambda pool, why: dropped.append((pool, why)))
        seen = []
        try:
            now = time.time()
            publish(now)
            await pods.refresh()
            seen.append(pods.pools())
            publish(now + 0.5)  # its last refresh, which the router has not read
            pod = pods.get("racy-0")
            assert pod is not None
            pods.drop_unreachable(pod)
            pods.drop_unreachable(pod)  # a second request failing on it changes nothing
            seen.append(pods.pools())
            for _ in range(2):
                await pods.refresh()
                seen.append(pods.pools())
            publish(now + 1.0)  # alive after all (or back): a record written since
            await pods.refresh()
            seen.append(pods.pools())
        finally:
            await pods.stop()
        assert dropped == [("decode", "refused")]
        return seen

    live = {"decode": ["racy-0"]}
    assert asyncio.run(main()) == [live, {}, {}, {}, live]
