"""Prefill/decode disaggregation between real `kvferry serve` processes over NIXL.

A prefill server (`--role prefill`) computes a prompt and holds its blocks; a decode
server (`--role decode`) pulls them over NIXL on loopback and decodes. Greedy outputs must
equal a colocated server's token for token, and every block taken must come back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from serve_helpers import ServerProcess

# Children inherit this; UCX logs a line per refused connection otherwise.
os.environ.setdefault("UCX_LOG_LEVEL", "fatal")

BLOCK_SIZE = 16
MAX_TOKENS = 8
# The tiny checkpoint's block: 2 layers x (K, V) x 16 tokens x 2 KV heads x 16 dims x 4 bytes.
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
REQUEST_TIMEOUT_S = 60.0


@dataclass
class Trio:
    prefill: ServerProcess
    decode: ServerProcess
    colocated: ServerProcess


@pytest.fixture(scope="module")
def trio(server_factory: Callable[..., ServerProcess], tiny_model: Path) -> Trio:
    common = ("--block-size", str(BLOCK_SIZE), "--served-model-name", "tiny")
    flags = (*common, "--kv-lease-seconds", "5")
    return Trio(
        prefill=server_factory(tiny_model, "--role", "prefill", *flags),
        decode=server_factory(tiny_model, "--role", "decode", *flags),
        colocated=server_factory(tiny_model, *common),
    )


def complete(server: ServerProcess, prompt: list[int], max_tokens: int,
             kv_transfer_params: dict[str, Any] | None = None) -> httpx.Response:
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0.0, "ignore_eos": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def prefill_then_decode(trio: Trio, prompt: list[int]) -> tuple[str, dict[str, Any]]:
    """Sends the prompt through both hops; returns the decode's text and the prefill's params."""
    first = complete(trio.prefill, prompt, 1, {"do_remote_decode": True})
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    return text_of(complete(trio.decode, prompt, MAX_TOKENS, params)), params


def used_blocks(server: ServerProcess) -> float:
    return server.metric("vllm:kv_cache_usage_perc")


def wait_for(predicate: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def bytes_pulled(server: ServerProcess) -> float:
    return server.metric("kvferry:kv_transfer_bytes_total")


def prompt_of(num_tokens: int, start: int) -> list[int]:
    return [(start + 7 * i) % 250 + 3 for i in range(num_tokens)]


@pytest.mark.parametrize("num_tokens", [5, 16 * 9 + 3])
def test_prefill_then_decode_equals_colocated(trio: Trio, num_tokens: int) -> None:
    prompt = prompt_of(num_tokens, num_tokens)
    expected = text_of(complete(trio.colocated, prompt, MAX_TOKENS))
    before = bytes_pulled(trio.decode)
    text, params = prefill_then_decode(trio, prompt)
    assert text == expected
    # Every prompt token but the last (computed on the decode side) came over NIXL.
    assert bytes_pulled(trio.decode) - before == -(-(num_tokens - 1) // BLOCK_SIZE) * BLOCK_BYTES
    assert len(params["remote_block_ids"]) == -(-num_tokens // BLOCK_SIZE)
    assert params["remote_request_id"] and params["remote_engine_id"]
    # The producer frees its blocks on the pull's notification, not at lease end.
    assert wait_for(lambda: trio.prefill.metric("kvferry:kv_blocks_held_for_transfer") == 0, 3)
    assert wait_for(lambda: used_blocks(trio.decode) == 0.0 and used_blocks(trio.prefill) == 0.0)


def test_prefix_hits_on_the_decode_side_shorten_the_pull(trio: Trio) -> None:
    shared = prompt_of(4 * BLOCK_SIZE, 1000)
    first = shared + prompt_of(2 * BLOCK_SIZE + 5, 2001)
    second = shared + prompt_of(3 * BLOCK_SIZE + 1, 3002)
    assert prefill_then_decode(trio, first)[0] == text_of(complete(trio.colocated, first, MAX_TOKENS))
    before = bytes_pulled(trio.decode)
    text, params = prefill_then_decode(trio, second)
    assert text == text_of(complete(trio.colocated, second, MAX_TOKENS))
    # The 4 shared blocks are decode-side prefix hits: only the other 3 of 7 are pulled.
    assert len(params["remote_block_ids"]) == 8
    assert bytes_pulled(trio.decode) - before == 3 * BLOCK_BYTES
    assert wait_for(lambda: used_blocks(trio.decode) == 0.0 and used_blocks(trio.prefill) == 0.0)
