"""Prefix-aware routing against fake engine pods that publish KV events through the real
registrar into a real Redis: token-id prompts are hashed by the router itself, and a pod
that restarts under the same name loses what its previous process cached."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from procs import Proc, fake_engine, router_process

SERVICE = "prefix"
BLOCK_SIZE = 16  # the fake pods' KV block size


def tokens(start: int, num_blocks: int) -> list[int]:
    """Distinct ids, `num_blocks` full blocks of them."""
    return list(range(start, start + num_blocks * BLOCK_SIZE))


def url(proc: Proc) -> str:
    return f"http://127.0.0.1:{proc.port}"  # type: ignore[attr-defined]


def metric(router: Proc, line_start: str) -> float:
    for line in httpx.get(url(router) + "/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.rpartition(" ")[2])
    return 0.0


def applied_events(router: Proc) -> float:
    return metric(router, "kvferry:router_kv_event_batches ")


def cache(pod: Proc, router: Proc, token_ids: list[int]) -> None:
    """`pod` publishes that it holds the prompt's blocks; returns once the router has them."""
    before = applied_events(router)
    httpx.post(url(pod) + "/fake/cache", json={"token_ids": token_ids}).raise_for_status()
    deadline = time.monotonic() + 10
    while applied_events(router) <= before:
        assert time.monotonic() < deadline, "the router never applied the KV event"
        time.sleep(0.02)


def pod_of(pods: dict[str, Proc], prompt: object) -> list[str]:
    """The pods that were sent a request with this exact prompt."""
    return [name for name, pod in pods.items()
            if any(b.get("prompt") == prompt for b in httpx.get(url(pod) + "/fake/requests").json())]


def tokenize_calls(pods: dict[str, Proc]) -> int:
    return sum(httpx.get(url(pod) + "/fake/tokenize_calls").json() for pod in pods.values())


def complete(router: Proc, prompt: object) -> None:
    client = openai.OpenAI(base_url=url(router) + "/v1", api_key="none", max_retries=0,
                           timeout=10)
    out = client.completions.create(model="fake", prompt=prompt, max_tokens=3)  # type: ignore[arg-type]
    assert out.choices[0].text == " a b c"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[dict[str, Proc]]:
    """Two fake pods (pod-a first by name: it wins every tie) behind a prefix-aware router."""
    tmp = tmp_path_factory.mktemp("prefix")
    procs: dict[str, Proc] = {}
    try:
        for name in ("pod-a", "pod-b"):
            procs[name] = fake_engine(tmp, redis_url, SERVICE, "both", name)
        procs["router"] = router_process(tmp, redis_url, SERVICE,
                                         env={"KVFERRY_ROUTING_DECODE": "prefix-aware"})
        deadline = time.monotonic() + 10
        while httpx.get(url(procs["router"]) + "/health").json()["pools"] != {
                "decode": ["pod-a", "pod-b"]}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def pods_only(service: dict[str, Proc]) -> dict[str, Proc]:
    return {k: v for k, v in service.items() if k.startswith("pod-")}


def test_a_token_id_prompt_goes_to_the_pod_holding_its_prefix(service: dict[str, Proc]) -> None:
    pods, router = pods_only(service), service["router"]
    held = tokens(1000, 3)
    cache(pods["pod-b"], router, held)
    calls = tokenize_calls(pods)
    prompt = held + [7, 8, 9]
    complete(router, prompt)
    assert pod_of(pods, prompt) == ["pod-b"]
    assert tokenize_calls(pods) == calls


def test_a_batch_of_token_id_prompts_is_hashed_and_remembered(service: dict[str, Proc]) -> None:
    pods, router = pods_only(service), service["router"]
    held = tokens(2000, 2)
    cache(pods["pod-b"], router, held)
    calls = tokenize_calls(pods)
    second = tokens(3000, 2)
    batch = [held + [5], second]
    complete(router, batch)
    assert pod_of(pods, batch) == ["pod-b"]
    # pod-b computed the batch's second prompt too: the router sends it there next time,
    # though no KV event said so and pod-a wins every tie.
    again = second + [11]
    complete(router, again)
    assert pod_of(pods, again) == ["pod-b"]
    assert tokenize_calls(pods) == calls


def test_token_ids_past_int64_are_left_to_the_engine(service: dict[str, Proc]) -> None:
    pods, router = pods_only(service), service["router"]
    prompt = [2**63] * BLOCK_SIZE
    response = httpx.post(url(router) + "/v1/completions",
                          json={"model": "fake", "prompt": prompt, "max_tokens": 3})
    # The fake engine accepts any ids; the router neither failed nor asked /tokenize.
    assert response.status_code == 200
    assert len(pod_of(pods, prompt)) == 1
