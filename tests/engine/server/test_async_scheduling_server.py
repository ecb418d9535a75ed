"""`kvferry serve --async-scheduling` answers the official `openai` client as a server
without it does: the same completions and chats, streamed and not, one at a time and
concurrently, and its KV cache is empty afterwards. A prefill and a decode pod with it
serve prefill-then-decode (a held prefill, a pull) as a colocated server without it."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from kvferry_testing.pd_pods import (
    MAX_TOKENS,
    prompt_of,
    start_role,
    text_of,
    used_blocks,
    wait_for,
)
from kvferry_testing.serve_helpers import API_KEY, ServerProcess

# Children inherit this; UCX logs a line per refused connection otherwise.
os.environ.setdefault("UCX_LOG_LEVEL", "fatal")

# Every token decodes to one word: special tokens (EOS, <unk>) stay in the text.
RAW = {"ignore_eos": True, "skip_special_tokens": False}
PROMPTS = ["w5 w6 w7", "w10 w11 w12 w13 w14", "w100", "w200 w3 w3 w3 w9", "w42 w43"]


@pytest.fixture(scope="module")
def async_server(server_factory: Callable[..., ServerProcess],
                 tiny_model: Path) -> Iterator[ServerProcess]:
    # Stopped with the module: servers of the whole session would not fit in memory.
    server = server_factory(tiny_model, "--served-model-name", "tiny", "--async-scheduling",
                            api_key=API_KEY)
    yield server
    server.kill_group()


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def clients(live_server: ServerProcess, async_server: ServerProcess) -> list[openai.OpenAI]:
    """A server without async scheduling, then one with it."""
    return [client_of(live_server), client_of(async_server)]


def completion(client: openai.OpenAI, **kwargs: Any) -> list[tuple]:
    out = client.completions.create(model="tiny", **kwargs)
    choices = sorted(out.choices, key=lambda c: c.index)
    return [(c.index, c.text, c.finish_reason, c.model_extra.get("stop_reason"),
             None if c.logprobs is None else (c.logprobs.tokens, c.logprobs.top_logprobs))
            for c in choices] + [(out.usage.prompt_tokens, out.usage.completion_tokens)]


def _completion_of(client: openai.OpenAI, case: dict[str, Any]) -> list[tuple]:
    return completion(client, **case)


def streamed_completion(client: openai.OpenAI, **kwargs: Any) -> tuple:
    chunks = list(client.completions.create(model="tiny", stream=True,
                                            stream_options={"include_usage": True}, **kwargs))
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    usage = chunks[-1].usage
    return texts, reasons, (usage.prompt_tokens, usage.completion_tokens)


def test_completions_equal_a_server_without_async_scheduling(
    clients: list[openai.OpenAI],
) -> None:
    cases = [
        {"prompt": PROMPTS, "max_tokens": 12, "temperature": 0},
        {"prompt": "w5 w6 w7", "max_tokens": 10, "n": 2, "temperature": 1.0, "seed": 3, "extra_body": RAW},
        {"prompt": "w10 w11", "max_tokens": 6, "temperature": 0, "logprobs": 3, "extra_body": RAW},
        {"prompt": "w200 w3", "max_tokens": 1, "temperature": 0, "extra_body": RAW},
    ]
    for case in cases:
        expected, actual = (completion(c, **case) for c in clients)
        assert actual == expected, case


def test_stop_strings_streamed_and_not_equal_a_server_without_async_scheduling(
    clients: list[openai.OpenAI],
) -> None:
    free = clients[0].completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=10,
                                         temperature=0, extra_body=RAW)
    stop_word = free.choices[0].text.split()[3]
    case = {"prompt": "w5 w6 w7", "max_tokens": 10, "temperature": 0, "stop": [stop_word],
                "extra_body": RAW}
    expected, actual = (completion(c, **case) for c in clients)
    assert actual == expected and expected[0][2] == "stop"
    expected, actual = (streamed_completion(c, **case) for c in clients)
    assert actual == expected and expected[1] == {0: "stop"}


def test_streamed_completions_and_chats_equal_a_server_without_async_scheduling(
    clients: list[openai.OpenAI],
) -> None:
    case = {"prompt": PROMPTS[:3], "max_tokens": 9, "temperature": 0.8, "seed": 7, "extra_body": RAW}
    expected, actual = (streamed_completion(c, **case) for c in clients)
    assert actual == expected and len(expected[0]) == 3
    messages = [{"role": "system", "content": "w3 w4"}, {"role": "user", "content": "w5 w6"}]

    def chat(client: openai.OpenAI) -> tuple:
        chunks = list(client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=7, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=RAW))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=7,
                                               temperature=0, extra_body=RAW)
        return text, whole.choices[0].message.content, chunks[-1].usage.completion_tokens

    expected, actual = (chat(c) for c in clients)
    assert actual == expected and expected[0] == expected[1] and expected[2] == 7


def test_concurrent_requests_equal_a_server_without_async_scheduling(
    clients: list[openai.OpenAI], async_server: ServerProcess,
) -> None:
    # Greedy and seeded requests in flight together share steps; their answers depend on
    # nothing else in the batch.
    cases = [{"prompt": p, "max_tokens": 8 + i, "temperature": 0 if i % 2 else 1.0, "seed": i,
                  "extra_body": RAW} for i, p in enumerate(PROMPTS * 2)]
    results = []
    for client in clients:
        with ThreadPoolExecutor(len(cases)) as pool:
            results.append(list(pool.map(functools.partial(_completion_of, client), cases)))
    assert results[1] == results[0]
    async_server.wait_metric("vllm:kv_cache_usage_perc", 0.0)
    async_server.wait_metric("vllm:num_requests_running", 0.0)


def test_prefill_then_decode_pods_with_async_scheduling_equal_a_colocated_server(
    server_factory: Callable[..., ServerProcess], tiny_model: Path,
    live_server: ServerProcess,
) -> None:
    prefill = start_role(server_factory, tiny_model, "prefill", "--async-scheduling")
    decode = start_role(server_factory, tiny_model, "decode", "--async-scheduling")
    try:
        _check_prefill_then_decode(prefill, decode, live_server)
    finally:  # stopped with the test: servers of the whole session would not fit in memory
        prefill.kill_group()
        decode.kill_group()


def _check_prefill_then_decode(prefill: ServerProcess, decode: ServerProcess,
                               live_server: ServerProcess) -> None:
    prompts = [prompt_of(5 + 7 * i, 700 + i) for i in range(24)]

    async def prefill_then_decode(client: httpx.AsyncClient, prompt: list[int]) -> str:
        body = {"model": "tiny", "prompt": prompt, "temperature": 0.0, "ignore_eos": True}
        first = await client.post(f"{prefill.url}/v1/completions", json={
            **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        assert first.status_code == 200, first.text
        params = first.json()["kv_transfer_params"]
        second = await client.post(f"{decode.url}/v1/completions", json={
            **body, "max_tokens": MAX_TOKENS, "kv_transfer_params": params})
        assert second.status_code == 200, second.text
        return second.json()["choices"][0]["text"]

    async def run_all() -> list[str]:
        async with httpx.AsyncClient(timeout=120.0) as client:
            return await asyncio.gather(*(prefill_then_decode(client, p) for p in prompts))

    texts = asyncio.run(run_all())
    headers = live_server.headers
    expected = [text_of(httpx.post(f"{live_server.url}/v1/completions", headers=headers, json={
        "model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "ignore_eos": True}, timeout=60)) for p in prompts]
    assert texts == expected
    assert wait_for(lambda: used_blocks(prefill) == 0.0 and used_blocks(decode) == 0.0)
    assert prefill.metric("kvferry:kv_blocks_held_for_transfer") == 0
    assert decode.metric("kvferry:kv_transfer_bytes_total") > 0
