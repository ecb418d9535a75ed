"""vllm-router's P/D mode in front of a kvferry prefill pod and a decode pod that share a
key: it passes the signed kv_transfer_params from one hop to the next unchanged, and the
decode pod pulls the prompt's KV over NIXL as it does behind kvferry's own router."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kvferry_testing.pd_pods import (
    BLOCK_BYTES,
    BLOCK_SIZE,
    MAX_TOKENS,
    REQUEST_TIMEOUT_S,
    Trio,
    bytes_pulled,
    complete,
    failures,
    prompt_of,
    text_of,
    used_blocks,
    wait_for,
)
from kvferry_testing.procs import Proc, free_port, wait_http

# Children inherit this; UCX logs a line per refused connection otherwise.
os.environ.setdefault("UCX_LOG_LEVEL", "fatal")


def vllm_router_binary() -> str | None:
    """vllm-router's launcher: beside this interpreter (a venv) or on PATH."""
    beside = Path(sys.executable).parent / "vllm-router"
    return str(beside) if beside.exists() else shutil.which("vllm-router")


@pytest.fixture(scope="module")
def vllm_router(trio: Trio, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    binary = vllm_router_binary()
    if binary is None:
        pytest.skip("vllm-router is not installed (pip install 'kvferry[bench]')")
    port = free_port()
    proc = Proc([binary, "--host", "127.0.0.1", "--port", str(port),
                 "--vllm-pd-disaggregation", "--kv-connector", "nixl",
                 "--prefill", trio.prefill.url, "--decode", trio.decode.url,
                 "--policy", "round_robin", "--log-level", "warning",
                 "--prometheus-port", str(free_port())],
                tmp_path_factory.mktemp("vllm-router") / "vllm-router.log")
    proc.port = port  # type: ignore[attr-defined]
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, 60)
        yield proc
    finally:
        proc.stop()


def test_vllm_router_drives_a_keyed_prefill_and_decode_pod(trio: Trio, vllm_router: Proc) -> None:
    prompt = prompt_of(4 * BLOCK_SIZE + 3, 300)
    expected = text_of(complete(trio.colocated, prompt, MAX_TOKENS))
    pulled = bytes_pulled(trio.decode)
    refused = failures(trio.decode, "bad_signature")
    held = trio.prefill.metric("kvferry:kv_blocks_held_for_transfer")
    url = f"http://127.0.0.1:{vllm_router.port}/v1/completions"  # type: ignore[attr-defined]
    response = httpx.post(url, json={
        "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "ignore_eos": True}, timeout=REQUEST_TIMEOUT_S)
    assert text_of(response) == expected, vllm_router.log()
    # The KV of every prompt token but the last came over NIXL: the params reached the
    # decode pod signed and intact.
    assert bytes_pulled(trio.decode) - pulled == -(-(len(prompt) - 1) // BLOCK_SIZE) * BLOCK_BYTES
    assert failures(trio.decode, "bad_signature") == refused
    assert wait_for(lambda: trio.prefill.metric("kvferry:kv_blocks_held_for_transfer") == held)
    assert wait_for(lambda: used_blocks(trio.decode) == 0.0)
