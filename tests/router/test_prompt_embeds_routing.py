"""`prompt_embeds` through the router against fake pods (real processes, real Redis): a long
embedding prompt takes the prefill hop and both pods get the embeddings; the router keys it
by the engines' block hashes (placeholder ids with the embeddings' hash), so a decode pod
whose KV events say it holds it gets it without a prefill hop; bad payloads and bodies are
refused before any hop; bodies with embeddings have their own limit."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from kvferry_testing.embeds import b64, code_running_archive, encode, huge_sparse
from kvferry_testing.procs import Proc, fake_engine, router_process

from kvferry.protocol.prompt_embeds import PLACEHOLDER_TOKEN_ID, embeds_salt

SERVICE = "embeds"
BODY_LIMIT = 100_000
EMBEDS_BODY_LIMIT = 2_000_000
HIDDEN = 64


def url(proc: Proc) -> str:
    return f"http://127.0.0.1:{proc.port}"  # type: ignore[attr-defined]


def metric(router: Proc, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(url(router) + "/metrics").text.splitlines():
        if line.startswith((name + "{", name + " ")):
            sample, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in sample for k, v in labels.items()):
                total += float(value)
    return total


def received(pod: Proc) -> list[dict[str, Any]]:
    return httpx.get(url(pod) + "/fake/requests").json()


def with_embeds(pods: dict[str, Proc], payload: str) -> dict[str, list[dict[str, Any]]]:
    """Per pod, the bodies it got that carry this payload."""
    return {name: [b for b in received(pod) if b.get("prompt_embeds") == payload]
            for name, pod in pods.items() if name != "router"}


def post(router: Proc, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url(router) + "/v1/completions", timeout=30,
                      json={"model": "fake", "max_tokens": 3, **body})


def embeddings(num_rows: int, seed: int) -> torch.Tensor:
    return torch.randn(num_rows, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[dict[str, Proc]]:
    """A prefill and two decode fake pods behind a router routing decodes by prefix."""
    tmp = tmp_path_factory.mktemp("embeds")
    procs: dict[str, Proc] = {}
    try:
        procs["prefill-0"] = fake_engine(tmp, redis_url, SERVICE, "prefill", "prefill-0")
        procs["decode-0"] = fake_engine(tmp, redis_url, SERVICE, "decode", "decode-0")
        procs["decode-1"] = fake_engine(tmp, redis_url, SERVICE, "decode", "decode-1")
        procs["router"] = router_process(
            tmp, redis_url, SERVICE, "--max-body-bytes", str(BODY_LIMIT),
            "--max-embeds-body-bytes", str(EMBEDS_BODY_LIMIT),
            env={"KVFERRY_ROUTING_DECODE": "prefix-aware"})
        expected = {"decode": ["decode-0", "decode-1"], "prefill": ["prefill-0"]}
        deadline = time.monotonic() + 10
        while httpx.get(url(procs["router"]) + "/health").json()["pools"] != expected:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def test_a_long_embedding_prompt_takes_both_hops_with_its_embeddings(pd) -> None:
    payload = encode(embeddings(300, 1))
    assert len(payload) > BODY_LIMIT  # past the plain limit, within the one for embeddings
    answer = post(pd["router"], {"prompt": "", "prompt_embeds": payload})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == " a b c"
    got = with_embeds(pd, payload)
    (prefill_body,) = got["prefill-0"]
    assert prefill_body["kv_transfer_params"] == {"do_remote_decode": True}
    assert prefill_body["max_tokens"] == 1
    # The decode pod gets the embeddings too (a failed pull recomputes from them), with
    # the prefill pod's params.
    (decode_body,) = got["decode-0"] + got["decode-1"]
    assert decode_body["kv_transfer_params"]["remote_engine_id"] == "prefill-0"


def test_short_and_batched_embedding_prompts_skip_the_prefill_hop(pd) -> None:
    short_skips = metric(pd["router"], "kvferry:router_prefill_skips_total", reason="short_prompt")
    short = encode(embeddings(10, 2))
    assert post(pd["router"], {"prompt_embeds": short}).status_code == 200
    assert metric(pd["router"], "kvferry:router_prefill_skips_total",
                  reason="short_prompt") == short_skips + 1
    batch_skips = metric(pd["router"], "kvferry:router_prefill_skips_total",
                         reason="not_one_prompt")
    batch = [encode(embeddings(300, 3)), encode(embeddings(300, 4))]
    assert post(pd["router"], {"prompt_embeds": batch}).status_code == 200
    assert metric(pd["router"], "kvferry:router_prefill_skips_total",
                  reason="not_one_prompt") == batch_skips + 1
    assert with_embeds(pd, short)["prefill-0"] == []


def test_a_decode_pod_holding_the_embedding_prompt_gets_it_without_a_prefill_hop(pd) -> None:
    """decode-1 publishes (KV events) the blocks an engine stores for these embeddings:
    placeholder ids hashed with their salt. The router's own hashing of the payload must
    find them."""
    tensor = embeddings(16 * 20, 5)
    placeholders = [PLACEHOLDER_TOKEN_ID] * tensor.shape[0]
    router = pd["router"]
    batches = metric(router, "kvferry:router_kv_event_batches")
    httpx.post(url(pd["decode-1"]) + "/fake/cache", json={
        "token_ids": placeholders, "cache_salt": embeds_salt(tensor).hex()}).raise_for_status()
    deadline = time.monotonic() + 10
    while metric(router, "kvferry:router_kv_event_batches") <= batches:
        assert time.monotonic() < deadline, "the router never applied the KV event"
        time.sleep(0.02)
    skips = metric(router, "kvferry:router_prefill_skips_total", reason="cached_on_decode")
    payload = encode(tensor)
    assert post(router, {"prompt_embeds": payload}).status_code == 200
    got = with_embeds(pd, payload)
    assert (len(got["prefill-0"]), len(got["decode-0"]), len(got["decode-1"])) == (0, 0, 1)
    assert metric(router, "kvferry:router_prefill_skips_total",
                  reason="cached_on_decode") == skips + 1
    # The same number of placeholder ids as a token prompt is another prompt: no skip.
    assert post(router, {"prompt": placeholders}).status_code == 200
    assert metric(router, "kvferry:router_prefill_skips_total",
                  reason="cached_on_decode") == skips + 1


def test_bad_embeddings_are_refused_before_any_hop(pd, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    before = {name: len(received(pod)) for name, pod in pd.items() if name != "router"}
    cases = [
        ({"prompt_embeds": "not base64!"}, "prompt_embeds is not valid base64"),
        ({"prompt_embeds": b64(code_running_archive(marker))},
         "its pickle asks for more than tensors"),
        ({"prompt_embeds": encode(huge_sparse())}, "prompt_embeds has layout sparse_coo"),
        ({"prompt_embeds": encode(torch.ones(4, HIDDEN, dtype=torch.int8))},
         "prompt_embeds has dtype int8"),
        ({"prompt_embeds": encode(embeddings(3, 6)), "prompt": "w5"},
         "give either prompt or prompt_embeds, not both"),
        ({"prompt_embeds": 5}, "prompt_embeds: Input should be a string or a list of strings"),
    ]
    for body, message in cases:
        answer = post(pd["router"], body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert message in error["message"] and error["param"] == "prompt_embeds"
    answer = post(pd["router"], {})
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == "prompt: Field required (or prompt_embeds)"
    assert not marker.exists()
    assert before == {name: len(received(pod)) for name, pod in pd.items() if name != "router"}


def test_bodies_with_embeddings_have_their_own_limit(pd) -> None:
    router = pd["router"]
    big = post(router, {"prompt": "w5", "user": "x" * BODY_LIMIT})
    assert big.status_code == 413
    assert "(--max-body-bytes)" in big.json()["error"]["message"]
    huge = post(router, {"prompt_embeds": "A" * EMBEDS_BODY_LIMIT})
    assert huge.status_code == 413
    assert "(--max-embeds-body-bytes for a body with prompt_embeds)" in \
        huge.json()["error"]["message"]
    chat = httpx.post(url(router) + "/v1/chat/completions", timeout=30, json={
        "model": "fake", "messages": [{"role": "user", "content": "w5"}],
        "user": "x" * BODY_LIMIT})
    assert chat.status_code == 413
