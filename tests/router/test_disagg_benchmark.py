"""The measuring parts of benchmarks/disagg.py: per-event timing of streamed completions from
a real HTTP server (the fake engine pod), failures told apart, figures read from real
Prometheus text, and no process of a `kvferry up` left behind when it dies."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kvferry_testing.benchmarks import load_benchmark
from kvferry_testing.procs import Proc, free_port, wait_http
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

disagg = load_benchmark("disagg")
local_service = load_benchmark("local_service")
Request = load_benchmark("serving_load").Request


@pytest.fixture(scope="module")
def fake_pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fake engine pod that streams three tokens per completion."""
    port = free_port()
    proc = Proc([sys.executable, "-m", "kvferry_testing.fake_engine", "--port", str(port)],
                tmp_path_factory.mktemp("fake") / "fake.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc, 60)
        yield url
    finally:
        proc.stop()


def behave(url: str, behaviour: str) -> None:
    httpx.post(url + "/fake/behaviour", json={"behaviour": behaviour}).raise_for_status()


def test_ttft_is_the_wait_for_the_first_event_and_itl_the_gaps() -> None:
    result = disagg.result_from_times(10.0, [10.5, 10.75, 11.75, 11.75], 12.0, 5)
    assert result.ok and result.num_output_tokens == 5
    assert result.ttft_s == 0.5 and result.e2e_s == 2.0
    assert result.inter_token_s == [0.25, 1.0, 0.0]
    nothing = disagg.result_from_times(10.0, [], 12.0, 5)
    assert not nothing.ok and nothing.error == "no tokens streamed"


def test_every_streamed_event_of_every_request_is_timed(fake_pod: str) -> None:
    behave(fake_pod, "ok")
    workload = [Request([5, 6, 7 + i], 3) for i in range(4)]
    results, duration = asyncio.run(
        disagg.send_workload(fake_pod, "fake", workload, float("inf"), 0))
    assert [r.error for r in results] == [""] * 4
    for result in results:
        assert len(result.inter_token_s) == 2  # three events, [DONE] not counted
        assert all(gap >= 0 for gap in result.inter_token_s)
        assert 0 < result.ttft_s <= result.e2e_s <= duration
    received = httpx.get(fake_pod + "/fake/requests").json()[-4:]
    assert sorted(received, key=lambda body: body["prompt"]) == [
        {"model": "fake", "prompt": [5, 6, 7 + i], "max_tokens": 3, "temperature": 0,
         "ignore_eos": True, "stream": True} for i in range(4)]


def test_refused_and_cut_streams_are_failures(fake_pod: str) -> None:
    request = [Request([5, 6], 3)]
    try:
        behave(fake_pod, "refuse")
        (refused,), _ = asyncio.run(disagg.send_workload(fake_pod, "fake", request, 1.0, 0))
        assert not refused.ok and refused.error.startswith("HTTP 503: b'{\"error\"")
        behave(fake_pod, "cut")
        (cut,), _ = asyncio.run(disagg.send_workload(fake_pod, "fake", request, 1.0, 0))
        assert not cut.ok and cut.error.startswith("RemoteProtocolError")
    finally:
        behave(fake_pod, "ok")


def test_counter_growth_and_mean_times_from_prometheus_text() -> None:
    registry = CollectorRegistry()
    hops = Counter("kvferry:router_hop_requests", "", ["hop", "outcome"], registry=registry)
    latency = Histogram("kvferry:router_hop_latency_seconds", "", ["hop"], registry=registry)
    hops.labels("prefill", "200").inc(3)
    hops.labels("prefill", "503").inc(1)
    hops.labels("decode", "200").inc(5)
    latency.labels("prefill").observe(0.25)
    text = generate_latest(registry).decode()
    name = "kvferry:router_hop_requests_total"
    assert local_service.metric_sum(text, name, 'hop="prefill",outcome="200"') == 3.0
    assert local_service.metric_sum(text, name) == 9.0
    assert local_service.metric_sum(text, "kvferry:router_hop_latency_seconds_count",
                                    'hop="prefill"') == 1.0

    before = disagg.Reading({"pod": 1.0}, {"pod": 0.5}, {"prefill hop": (0.25, 1.0)}, 3.0, 0.0)
    after = disagg.Reading({"pod": 4.0}, {"pod": 2.0}, {"prefill hop": (1.75, 4.0)}, 6.0, 1.0)
    grown = after.since(before)
    assert (grown.cpu_s, grown.wait_s, grown.prefill_hops, grown.kv_fallbacks) == (
        {"pod": 3.0}, {"pod": 1.5}, 3.0, 1.0)
    assert grown.mean_ms() == {"prefill hop": 500.0}


def is_running(pid: int) -> bool:
    return local_service.running_since(pid) is not None


def test_stop_kills_what_a_dead_kvferry_up_left_behind(tmp_path: Path) -> None:
    manifest = disagg.service_manifest("orphans", {"decode": {"replicas": 1}}, 512)
    manifest["spec"]["engine"]["extraArgs"] = ["--kv-cache-memory-bytes", str(16 << 20)]
    service = local_service.LocalService(manifest, tmp_path, dict(os.environ))
    try:
        service.wait_ready(240)
        components = service.components()
        assert sorted(components) == ["orphans-decode-0", "redis", "router"]
        pids = [pid for tree in components.values() for pid in tree]
        assert len(components["orphans-decode-0"]) == 2  # the server and its engine core
        os.kill(service.proc.pid, signal.SIGKILL)  # `kvferry up` dies without stopping them
        service.proc.wait()
        assert all(is_running(pid) for pid in pids)
    finally:
        killed = service.stop()
    assert sorted(killed) == sorted(pids)
    deadline = time.monotonic() + 10
    while any(is_running(pid) for pid in pids):
        assert time.monotonic() < deadline, [p for p in pids if is_running(p)]
        time.sleep(0.05)
