"""Prefill/decode pods for the server tests: a prefill, a decode and a colocated `kvferry
serve` of the tiny checkpoint (keyed alike), and what the tests ask of them."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvferry_testing.keys import KEYED_ENV
from kvferry_testing.serve_helpers import ServerProcess

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


def prompt_of(num_tokens: int, seed: int) -> list[int]:
    """Random token ids: prompts of different seeds share no prefix block (no hidden hits)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(num_tokens)]


def failures(server: ServerProcess, reason: str) -> float:
    return server.metrics()[f'kvferry:kv_transfer_failures_total{{model_name="tiny",reason="{reason}"}}']


def start_role(server_factory: Callable[..., ServerProcess], model: Path, role: str,
               *flags: str) -> ServerProcess:
    return server_factory(model, "--role", role, "--block-size", str(BLOCK_SIZE),
                          "--served-model-name", "tiny", *flags, env=KEYED_ENV)


def kill_pod(server: ServerProcess) -> None:
    """Kills a server and its engine core at once, as a pod dies (the core would otherwise
    notice its parent gone only at its next check)."""
    core_pid = server.engine_pid()
    os.kill(core_pid, signal.SIGKILL)
    server.kill_group()
    assert wait_for(lambda: not Path(f"/proc/{core_pid}").exists() or _is_zombie(core_pid), 10)


def _is_zombie(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    return True


def held_params(prefill: ServerProcess, prompt: list[int]) -> dict[str, Any]:
    response = complete(prefill, prompt, 1, {"do_remote_decode": True})
    assert response.status_code == 200, response.text
    return response.json()["kv_transfer_params"]


def start_trio(server_factory: Callable[..., ServerProcess], model: Path) -> Trio:
    """Prefill and decode pods sharing the tests' key, and a colocated pod to compare with."""
    common = ("--block-size", str(BLOCK_SIZE), "--served-model-name", "tiny")
    flags = (*common, "--kv-lease-seconds", "5")
    return Trio(
        prefill=server_factory(model, "--role", "prefill", *flags, env=KEYED_ENV),
        decode=server_factory(model, "--role", "decode", *flags, env=KEYED_ENV),
        colocated=server_factory(model, *common),
    )
