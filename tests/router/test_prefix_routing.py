"""Prefix-aware routing against fake engine pods that publish KV events through the real
registrar into a real Redis: token-id prompts are hashed by the router itself, a pod that
restarts under the same name loses what its previous process cached, and a router given
the engines' tokenizer hashes text prompts without a pod's /tokenize."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis
from kvferry.engine.frontend.tokenizer import Tokenizer
from kvferry_testing.procs import Proc, fake_engine, router_process

from kvferry.protocol.kv_events import kv_events_key

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


def wait_applied(router: Proc, num_events: float) -> None:
    deadline = time.monotonic() + 10
    while applied_events(router) < num_events:
        assert time.monotonic() < deadline, "the router did not apply the KV events"
        time.sleep(0.02)


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
            if any(body.get("prompt") == prompt
                   for body in httpx.get(url(pod) + "/fake/requests").json())]


def tokenize_calls(pods: dict[str, Proc]) -> int:
    return sum(httpx.get(url(pod) + "/fake/tokenize_calls").json() for pod in pods.values())


def complete(router: Proc, prompt: object) -> None:
    client = openai.OpenAI(base_url=url(router) + "/v1", api_key="none", max_retries=0,
                           timeout=10)
    out = client.completions.create(model="fake", prompt=prompt, max_tokens=3)  # type: ignore[arg-type]
    assert out.choices[0].text == " a b c"


@dataclass
class Service:
    """Two fake pods (pod-a first by name: it wins every tie) behind a prefix-aware router."""

    tmp: Path
    redis_url: str
    pods: dict[str, Proc]
    router: Proc

    def restart(self, name: str) -> None:
        """Kills the pod's process (its registry key stays until its TTL) and starts a new
        one under the same name at once."""
        self.pods[name].stop(signal.SIGKILL)
        self.pods[name] = fake_engine(self.tmp, self.redis_url, SERVICE, "both", name)


def prefix_router(tmp: Path, redis_url: str) -> Proc:
    router = router_process(tmp, redis_url, SERVICE, env={"KVFERRY_ROUTING_DECODE": "prefix-aware"})
    deadline = time.monotonic() + 10
    while httpx.get(url(router) + "/health").json()["pools"] != {"decode": ["pod-a", "pod-b"]}:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return router


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("prefix")
    pods: dict[str, Proc] = {}
    router = None
    try:
        for name in ("pod-a", "pod-b"):
            pods[name] = fake_engine(tmp, redis_url, SERVICE, "both", name)
        router = prefix_router(tmp, redis_url)
        yield Service(tmp, redis_url, pods, router)
    finally:
        for proc in [*pods.values(), *([router] if router else [])]:
            proc.stop()


def test_a_token_id_prompt_goes_to_the_pod_holding_its_prefix(service: Service) -> None:
    pods, router = service.pods, service.router
    held = tokens(1000, 3)
    cache(pods["pod-b"], router, held)
    calls = tokenize_calls(pods)
    prompt = held + [7, 8, 9]
    complete(router, prompt)
    assert pod_of(pods, prompt) == ["pod-b"]
    assert tokenize_calls(pods) == calls


def test_a_batch_of_token_id_prompts_is_hashed_and_remembered(service: Service) -> None:
    pods, router = service.pods, service.router
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


def test_token_ids_past_int64_are_refused_as_the_engines_refuse_them(service: Service) -> None:
    prompt = [2**63] * BLOCK_SIZE
    calls = tokenize_calls(service.pods)
    response = httpx.post(url(service.router) + "/v1/completions",
                          json={"model": "fake", "prompt": prompt, "max_tokens": 3})
    # The engines' 400 (their ids are 64-bit), from the router itself: no pod was asked.
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"
    assert pod_of(service.pods, prompt) == []
    assert tokenize_calls(service.pods) == calls


def test_a_restarted_pod_loses_its_prefix_entries(service: Service) -> None:
    pods, router = service.pods, service.router
    held = tokens(4000, 3)
    cache(pods["pod-b"], router, held)
    complete(router, held + [1])
    assert pod_of(pods, held + [1]) == ["pod-b"]
    before = applied_events(router)
    service.restart("pod-b")
    wait_applied(router, before + 1)  # the new process's first entry
    complete(router, held + [2])
    assert pod_of(pods, held + [2]) == ["pod-a"]


def test_a_router_replaying_the_events_skips_a_restarted_pods_old_blocks(
        service: Service) -> None:
    pods = service.pods
    held = tokens(5000, 3)
    cache(pods["pod-b"], service.router, held)
    before = applied_events(service.router)
    service.restart("pod-b")
    wait_applied(service.router, before + 1)
    # A router started now reads the whole stream: pod-b's old process's entries, then the
    # new process's.
    late = prefix_router(service.tmp, service.redis_url)
    try:
        length = redis.Redis.from_url(service.redis_url).xlen(kv_events_key(SERVICE))
        wait_applied(late, length)
        complete(late, held + [3])
    finally:
        late.stop()
    assert pod_of(pods, held + [3]) == ["pod-a"]


def word_tokenizer(directory: Path) -> Tokenizer:
    """A word-level tokenizer.json whose ids (100 and up) no fake /tokenize could give."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    words = "the river runs past a town where bridges cross it at dawn".split()
    vocab = {"[UNK]": 0, **{word: 100 + i for i, word in enumerate(words)}}
    backend = Backend(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    return Tokenizer.from_pretrained(directory)


def test_a_router_given_the_tokenizer_hashes_text_without_asking_a_pod(service: Service) -> None:
    pods = service.pods
    tokenizer = word_tokenizer(service.tmp / "words")
    text = " ".join(["the river runs past a town where bridges cross it at dawn"] * 4)
    token_ids = tokenizer.encode(text)
    assert len(token_ids) >= 3 * BLOCK_SIZE
    local = router_process(service.tmp, service.redis_url, SERVICE, "--tokenizer",
                           str(service.tmp / "words"),
                           env={"KVFERRY_ROUTING_DECODE": "prefix-aware"})
    try:
        cache(pods["pod-b"], local, token_ids)
        calls = tokenize_calls(pods)
        complete(local, text)
        assert pod_of(pods, text) == ["pod-b"]
        assert tokenize_calls(pods) == calls
        # Chat goes through the engine's template: a pod still tokenizes it.
        chat = openai.OpenAI(base_url=url(local) + "/v1", api_key="none", max_retries=0)
        chat.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}])
        assert tokenize_calls(pods) == calls + 1
        assert metric(local, 'kvferry:router_tokenized_prompts_total{where="router"}') == 1
    finally:
        local.stop()


def test_a_tokenizer_that_cannot_be_loaded_is_a_clear_cli_error(tmp_path: Path,
                                                                  redis_url: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvferry.cli", "router", "--service", SERVICE,
         "--redis", redis_url, "--tokenizer", str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert "kvferry router: error:" in result.stderr and "tokenizer.json" in result.stderr
