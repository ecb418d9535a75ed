"""Many concurrent streams all complete with the right token counts; a client that
disconnects mid-stream frees its engine resources at once."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import httpx

from kvferry_testing.serve_helpers import ServerProcess

NUM_STREAMS = 1000
MAX_TOKENS = 4
# Tokens of a request that must still be running when its client goes away.
LONG = 1000


async def _stream_one(client: httpx.AsyncClient, index: int) -> tuple[int, str, int, int]:
    """(index, response id, content chunks, completion tokens from the usage chunk)."""
    body = {"prompt": f"w{3 + index % 200} w{5 + index % 100}", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0}
    ids: set[str] = set()
    num_chunks = 0
    usage = -1
    async with client.stream("POST", "/v1/completions", json=body,
                             headers={"X-Request-Id": f"load-{index}"}) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["x-request-id"] == f"load-{index}"
        lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        ids.add(chunk["id"])
        if chunk["choices"]:
            num_chunks += 1
        else:
            usage = chunk["usage"]["completion_tokens"]
    assert len(ids) == 1
    return index, ids.pop(), num_chunks, usage


def test_a_thousand_concurrent_streams(live_server: ServerProcess) -> None:
    async def run() -> list[tuple[int, str, int, int]]:
        limits = httpx.Limits(max_connections=NUM_STREAMS, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=live_server.url, headers=live_server.headers,
                                     limits=limits, timeout=120) as client:
            return await asyncio.gather(*(_stream_one(client, i) for i in range(NUM_STREAMS)))

    start = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - start
    assert sorted(r[0] for r in results) == list(range(NUM_STREAMS))
    assert len({r[1] for r in results}) == NUM_STREAMS  # none duplicated
    assert Counter(r[3] for r in results) == {MAX_TOKENS: NUM_STREAMS}
    # Each token is its own chunk except where a step delivered two at once (never here).
    assert all(1 <= r[2] <= MAX_TOKENS for r in results)
    assert elapsed < 90, elapsed
    log = live_server.log()
    assert sum(f"request_id=load-{i} " in log for i in range(NUM_STREAMS)) == NUM_STREAMS


def _wait_for(condition, timeout_s: float = 10.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_disconnect_mid_stream_frees_the_request(live_server: ServerProcess) -> None:
    server = live_server
    assert _wait_for(lambda: server.metric("vllm:num_requests_running") == 0)
    idle_usage = server.metric("vllm:kv_cache_usage_perc")
    aborts_before = server.metrics()[
        'vllm:request_success_total{finished_reason="abort",model_name="tiny"}']
    body = {"prompt": "w5 w6 w7", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as client:
        for _ in range(3):
            with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                received = [next(lines) for _ in range(6)]  # a few chunks, then hang up
                assert sum(line.startswith("data: {") for line in received) >= 3
                assert server.metric("vllm:num_requests_running") >= 1
                assert server.metric("vllm:kv_cache_usage_perc") > idle_usage
    assert _wait_for(lambda: server.metric("vllm:num_requests_running") == 0)
    assert _wait_for(lambda: server.metric("vllm:kv_cache_usage_perc") == idle_usage)
    aborts = server.metrics()['vllm:request_success_total{finished_reason="abort",model_name="tiny"}']
    assert aborts == aborts_before + 3
    assert "finish_reason=abort" in server.log()


def test_disconnect_of_a_non_streaming_request(live_server: ServerProcess) -> None:
    server = live_server
    aborts_key = 'vllm:request_success_total{finished_reason="abort",model_name="tiny"}'
    aborts_before = server.metrics()[aborts_key]
    body = {"prompt": "w5 w6 w7", "max_tokens": LONG, "ignore_eos": True}
    try:
        httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers,
                   timeout=0.3)
    except httpx.TimeoutException:
        pass
    assert _wait_for(lambda: server.metrics()[aborts_key] == aborts_before + 1)
    assert _wait_for(lambda: server.metric("vllm:num_requests_running") == 0)
