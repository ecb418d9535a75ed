"""`kvferry serve --pipeline-parallel-size 2` (two worker processes, gloo on CPU) answers the
official `openai` client as the single-process engine does on the same 3-layer random
checkpoint; a killed stage ends the requests in flight with an error within seconds and
the server exits non-zero (the pod restarts)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from kvferry_testing.pd_pods import (
    BLOCK_SIZE,
    MAX_TOKENS,
    Trio,
    bytes_pulled,
    failures,
    prefill_then_decode,
    prompt_of,
    start_role,
    used_blocks,
    wait_for,
)
from kvferry_testing.serve_helpers import API_KEY, KV_CACHE_BYTES, MAX_MODEL_LEN, ServerProcess

from kvferry import LLM, SamplingParams

PROMPTS = ["w5 w6 w7", "w10 w11 w12 w13 w14", "w100", "w200 w3 w3 w3 w9", "w42 w43"]
# Every token decodes to one word: special tokens (EOS, <unk>) stay in the text.
RAW = {"ignore_eos": True, "skip_special_tokens": False}


@pytest.fixture(scope="module")
def model(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint(num_layers=3, vocab_size=256, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def server(server_factory: Callable[..., ServerProcess], model: Path) -> Iterator[ServerProcess]:
    server = server_factory(model, "--served-model-name", "tiny",
                            "--pipeline-parallel-size", "2", api_key=API_KEY)
    yield server
    server.kill_group()


@pytest.fixture(scope="module")
def offline(model: Path) -> Iterator[LLM]:
    """The single-process engine on the same checkpoint and limits."""
    llm = LLM(str(model), max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_CACHE_BYTES,
              device="cpu")
    yield llm
    llm.shutdown()


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=60)


def offline_texts(llm: LLM, prompts: list[str], **params: object) -> list[list[str]]:
    outputs = llm.generate(prompts, SamplingParams(skip_special_tokens=False, ignore_eos=True,
                                                   **params), use_tqdm=False)
    return [[c.text for c in o.outputs] for o in outputs]


def server_texts(client: openai.OpenAI, prompt: str | list[str], **params: object) -> list[str]:
    out = client.completions.create(model="tiny", prompt=prompt, extra_body=RAW, **params)
    return [c.text for c in sorted(out.choices, key=lambda c: c.index)]


def test_completions_equal_the_single_process_engine(server: ServerProcess, offline: LLM) -> None:
    client = client_of(server)
    expected = [texts[0] for texts in offline_texts(offline, PROMPTS, temperature=0.0,
                                                    max_tokens=12)]
    assert server_texts(client, PROMPTS, temperature=0, max_tokens=12) == expected
    # Seeded sampling: n = 2 completions, each with its own seed-derived noise.
    [seeded] = offline_texts(offline, ["w5 w6 w7"], temperature=1.0, seed=3, n=2,
                             max_tokens=10)
    assert server_texts(client, "w5 w6 w7", temperature=1.0, seed=3, n=2,
                        max_tokens=10) == seeded
    # Streamed.
    chunks = list(client.completions.create(model="tiny", prompt="w10 w11", max_tokens=9,
                                            temperature=0, stream=True, extra_body=RAW))
    [[streamed]] = offline_texts(offline, ["w10 w11"], temperature=0.0, max_tokens=9)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == streamed


def test_concurrent_requests_equal_the_single_process_engine(
    server: ServerProcess, offline: LLM,
) -> None:
    client = client_of(server)
    cases = [(p, 6 + i) for i, p in enumerate(PROMPTS * 2)]
    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(lambda case: server_texts(
            client, case[0], temperature=0, max_tokens=case[1])[0], cases))
    expected = [offline_texts(offline, [p], temperature=0.0, max_tokens=n)[0][0]
                for p, n in cases]
    assert got == expected
    server.wait_metric("vllm:kv_cache_usage_perc", 0.0)
    server.wait_metric("vllm:num_requests_running", 0.0)


def test_tensor_parallel_serving_equals_the_single_process_engine(
    server_factory: Callable[..., ServerProcess], model: Path, offline: LLM,
) -> None:
    """`--tensor-parallel-size 2`: two workers, each with half the heads, MLP columns and
    vocabulary (4 query heads, 2 kv heads)."""
    server = server_factory(model, "--served-model-name", "tiny",
                            "--tensor-parallel-size", "2", api_key=API_KEY)
    try:
        client = client_of(server)
        expected = [texts[0] for texts in offline_texts(offline, PROMPTS, temperature=0.0,
                                                        max_tokens=10)]
        assert server_texts(client, PROMPTS, temperature=0, max_tokens=10) == expected
        [seeded] = offline_texts(offline, ["w5 w6 w7"], temperature=1.0, seed=3, n=2,
                                 max_tokens=8)
        assert server_texts(client, "w5 w6 w7", temperature=1.0, seed=3, n=2,
                            max_tokens=8) == seeded
        assert len(_stage_pids(server.engine_pid())) == 2
    finally:
        server.kill_group()


def test_prefill_and_decode_pods_of_two_stages_disaggregate(
    server_factory: Callable[..., ServerProcess], model: Path, offline: LLM,
) -> None:
    """A `--role prefill` and a `--role decode` server, both `--pipeline-parallel-size 2`:
    the decode pod pulls each stage's blocks from the prefill pod's same stage over NIXL,
    and answers as the single-process engine does."""
    prefill = start_role(server_factory, model, "prefill", "--pipeline-parallel-size", "2")
    decode = start_role(server_factory, model, "decode", "--pipeline-parallel-size", "2")
    try:
        prompt = prompt_of(3 * BLOCK_SIZE + 5, seed=11)
        [expected] = offline.generate({"prompt_token_ids": prompt}, SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
        text, params = prefill_then_decode(Trio(prefill, decode, colocated=prefill), prompt)
        assert text == expected.outputs[0].text
        assert len(params["remote_block_ids"]) == 4
        # All but the last prompt token: 4 blocks of all 3 layers (2 on stage 0, 1 on
        # stage 1), 2 kv heads of 16 float32 dims each.
        assert bytes_pulled(decode) == 4 * 3 * 2 * BLOCK_SIZE * 2 * 16 * 4
        assert failures(decode, "incompatible") == 0
        assert wait_for(lambda: used_blocks(prefill) == 0.0 and used_blocks(decode) == 0.0)
        assert len(_stage_pids(decode.engine_pid())) == 2
    finally:
        prefill.kill_group()
        decode.kill_group()


# Last in the module: it ends the server.
def test_a_killed_stage_fails_requests_and_the_server_exits_non_zero(
    server: ServerProcess,
) -> None:
    stages = _stage_pids(server.engine_pid())
    asyncio.run(_check_stage_death(server, stages[-1]))
    assert server.proc.wait(timeout=15) != 0
    log = server.log()
    assert "engine dead" in log and "pipeline stage 1" in log
    # The engine core reaped the surviving stage before it exited.
    assert not Path(f"/proc/{stages[0]}").exists()


async def _check_stage_death(server: ServerProcess, stage_pid: int) -> None:
    url, headers = server.url, server.headers
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}

    async def stream() -> tuple[int, list[str]]:
        async with httpx.AsyncClient(timeout=60, headers=headers) as client, \
                client.stream("POST", f"{url}/v1/completions", json=body) as response:
            return response.status_code, [x async for x in response.aiter_lines()
                                          if x.startswith("data: ")]

    streams = [asyncio.create_task(stream()) for _ in range(2)]
    deadline = time.monotonic() + 60
    while await asyncio.to_thread(server.metric, "vllm:num_requests_running") != 2:
        assert time.monotonic() < deadline, "the requests did not start"
        await asyncio.sleep(0.05)
    killed_at = time.monotonic()
    os.kill(stage_pid, signal.SIGKILL)
    for status, lines in await asyncio.gather(*streams):
        assert status == 200
        errors = [json.loads(x[6:]) for x in lines if '"error"' in x]
        assert errors, lines[-3:]
        assert lines[-1] == "data: [DONE]"
    assert time.monotonic() - killed_at < 5.0


def _stage_pids(engine_pid: int) -> list[int]:
    """The engine core's pipeline workers, in start order (stage 0 first)."""
    out = subprocess.run(["pgrep", "-P", str(engine_pid)], capture_output=True, text=True,
                         check=False).stdout.split()
    pids = [int(pid) for pid in out
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(pids) == 2, out
    return sorted(pids)
