"""Prompt embeddings across a prefill and a decode pod: the decode pod pulls the KV the
prefill pod computed from the embeddings, takes none computed from other embeddings of the
same length, and recomputes from its own copy of the embeddings when a pull cannot be had."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from kvferry_testing.embeds import embedding_table, encode
from kvferry_testing.pd_pods import (
    BLOCK_BYTES,
    BLOCK_SIZE,
    REQUEST_TIMEOUT_S,
    bytes_pulled,
    prompt_of,
    start_role,
    used_blocks,
    wait_for,
)
from kvferry_testing.serve_helpers import ServerProcess

os.environ.setdefault("UCX_LOG_LEVEL", "fatal")

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def pods(server_factory: Callable[..., ServerProcess],
         tiny_model: Path) -> tuple[ServerProcess, ServerProcess, torch.Tensor]:
    flags = ("--enable-prompt-embeds", "--kv-lease-seconds", "5")
    return (start_role(server_factory, tiny_model, "prefill", *flags),
            start_role(server_factory, tiny_model, "decode", *flags),
            embedding_table(tiny_model))


def complete(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{server.url}/v1/completions", timeout=REQUEST_TIMEOUT_S, json={
        "model": "tiny", "temperature": 0.0, "ignore_eos": True, "max_tokens": MAX_TOKENS,
        **body})
    assert response.status_code == 200, response.text
    return response.json()


def prefill(server: ServerProcess, embeds: str) -> dict[str, Any]:
    answer = complete(server, {"prompt_embeds": embeds, "max_tokens": 1,
                               "kv_transfer_params": {"do_remote_decode": True}})
    return answer["kv_transfer_params"]


def test_the_decode_pod_pulls_what_the_prefill_pod_computed(pods) -> None:
    prefill_pod, decode_pod, table = pods
    prompt = prompt_of(16 * 6 + 5, 1)
    expected = complete(decode_pod, {"prompt": prompt})["choices"][0]["text"]
    embeds = encode(table[prompt])
    params = prefill(prefill_pod, embeds)
    before = bytes_pulled(decode_pod)
    answer = complete(decode_pod, {"prompt_embeds": embeds, "kv_transfer_params": params})
    assert answer["choices"][0]["text"] == expected.removeprefix(" ")
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    # Every row but the last came over NIXL; the last is computed from the embeddings.
    assert bytes_pulled(decode_pod) - before == -(-(len(prompt) - 1) // BLOCK_SIZE) * BLOCK_BYTES
    assert wait_for(lambda: used_blocks(decode_pod) == 0.0 and used_blocks(prefill_pod) == 0.0)


def test_kv_of_other_embeddings_of_the_same_length_is_never_taken(pods) -> None:
    """Placeholder ids are alike for every embedding prompt of a length: the prompt hash in
    the params covers the embeddings' hash too, so the decode pod computes its own."""
    prefill_pod, decode_pod, table = pods
    mine, theirs = prompt_of(16 * 4 + 3, 2), prompt_of(16 * 4 + 3, 3)
    expected = complete(decode_pod, {"prompt": mine})["choices"][0]["text"]
    params = prefill(prefill_pod, encode(table[theirs]))
    before = bytes_pulled(decode_pod)
    answer = complete(decode_pod, {"prompt_embeds": encode(table[mine]),
                                   "kv_transfer_params": params})
    assert answer["choices"][0]["text"] == expected.removeprefix(" ")
    assert bytes_pulled(decode_pod) == before
    assert wait_for(lambda: used_blocks(decode_pod) == 0.0 and used_blocks(prefill_pod) == 0.0)


def test_a_failed_pull_recomputes_from_the_embeddings(pods) -> None:
    """Params the decode pod refuses (their signature no longer verifies) under policy
    recompute: it computes the prompt from the embeddings the request carries."""
    prefill_pod, decode_pod, table = pods
    prompt = prompt_of(16 * 5 + 1, 4)
    expected = complete(decode_pod, {"prompt": prompt})["choices"][0]["text"]
    embeds = encode(table[prompt])
    params = prefill(prefill_pod, embeds)
    tampered = {**params, "remote_block_ids": list(reversed(params["remote_block_ids"]))}
    fallbacks = decode_pod.metric("kvferry:kv_transfer_fallbacks_total")
    answer = complete(decode_pod, {"prompt_embeds": embeds, "kv_transfer_params": tampered})
    assert answer["choices"][0]["text"] == expected.removeprefix(" ")
    assert decode_pod.metric("kvferry:kv_transfer_fallbacks_total") == fallbacks + 1
    # The prefill pod's hold ends by its lease.
    assert wait_for(lambda: used_blocks(prefill_pod) == 0.0, 15)
