"""The process lifecycle of `kvferry serve`: 503 while loading, chat templates, the waiting
queue limit (429), SIGTERM drain (exit 0), engine death (errors within 5 s, exit non-zero)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvferry_testing.serve_helpers import ServerProcess

CHAT_TEMPLATE = (
    "{% for m in messages %}w9 {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w8 {% endif %}"
)
# Tokens of each request in flight during the drain: long enough to outlast the signal.
LONG = 1000
# The request running while the queue fills: long enough that it cannot finish, freeing a
# place, before the queue limit and the drain are checked on a loaded machine.
LONGEST = 6000


@pytest.fixture(scope="module")
def untemplated_model(make_checkpoint: Callable[..., Path],
                      tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint of LONGEST-plus positions with its chat template removed."""
    path = tmp_path_factory.mktemp("untemplated") / "model"
    shutil.copytree(make_checkpoint(vocab_size=256, max_position_embeddings=8192), path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    return path


async def _stream(url: str, body: dict, timeout: float = 60) -> tuple[int, list[str], float]:
    """(status, data lines, seconds until the stream ended)."""
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=timeout) as client, \
            client.stream("POST", f"{url}/v1/completions", json=body) as response:
        lines = [x async for x in response.aiter_lines() if x.startswith("data: ")]
        return response.status_code, lines, time.monotonic() - start


def _completion_tokens(lines: list[str]) -> int:
    usage = [json.loads(x[6:]) for x in lines if x != "data: [DONE]"]
    return next(c["usage"]["completion_tokens"] for c in usage if not c["choices"])


def _long_body(max_tokens: int) -> dict:
    return {"prompt": "w5 w6", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def test_drain_on_sigterm_with_a_template_override_and_a_queue_limit(
        server_factory: Callable[..., ServerProcess], untemplated_model: Path,
        tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    server = server_factory(untemplated_model, "--chat-template", str(template),
                            "--max-num-seqs", "1", "--max-num-waiting", "2",
                            "--max-model-len", "8192", "--drain-timeout", "120", wait=False)
    _check_loading(server)
    server.wait_ready()
    # While the model loaded, /ping answered 200 and /health 503.
    assert (200, 503) in server.probes
    _check_template_override(server)
    asyncio.run(_check_queue_limit_then_drain(server))
    assert server.proc.wait(timeout=30) == 0
    assert "SIGTERM: draining" in server.log()


def _check_loading(server: ServerProcess) -> None:
    """The HTTP server answers before the engine has loaded: 503s, and /ping 200."""
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline and server.proc.poll() is None, server.log()
        try:
            if httpx.get(f"{server.url}/ping", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.02)
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "w5"}, timeout=10)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["message"] == "the model is loading; retry shortly"
    assert httpx.get(f"{server.url}/health", timeout=2).status_code == 503


def _check_template_override(server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 2}
    out = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert out.status_code == 200, out.text
    # "w9 w5 w6 w8 ": the override template's words, not the role names.
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": body["messages"]}).json()
    assert tokens["tokens"] == [9, 5, 6, 8]
    assert out.json()["usage"]["prompt_tokens"] == 4


async def _check_queue_limit_then_drain(server: ServerProcess) -> None:
    url = server.url
    # One running, two waiting (max_num_seqs 1): a fourth is refused with 429.
    tasks = []
    for running, waiting in ((1, 0), (1, 1), (1, 2)):
        max_tokens = LONGEST if not tasks else LONG
        tasks.append(asyncio.create_task(_stream(url, _long_body(max_tokens), timeout=180)))
        await _until(lambda expected=(running, waiting): (
            server.metric("vllm:num_requests_running"),
            server.metric("vllm:num_requests_waiting")) == expected)
    async with httpx.AsyncClient() as client:
        refused = await client.post(f"{url}/v1/completions", json={"prompt": "w5"})
    assert refused.status_code == 429, refused.text
    assert "waiting" in refused.json()["error"]["message"]
    server.proc.send_signal(signal.SIGTERM)
    await _until(lambda: httpx.get(f"{url}/health").status_code == 503)
    async with httpx.AsyncClient() as client:
        late = await client.post(f"{url}/v1/completions", json={"prompt": "w5"})
        assert (await client.get(f"{url}/ping")).status_code == 200
    assert late.status_code == 503, late.text
    assert "shutting down" in late.json()["error"]["message"]
    results = await asyncio.gather(*tasks)
    for (status, lines, _), max_tokens in zip(results, (LONGEST, LONG, LONG)):
        assert status == 200
        assert lines[-1] == "data: [DONE]"
        assert _completion_tokens(lines) == max_tokens  # every in-flight request ran to the end


async def _until(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def test_engine_death_fails_requests_and_exits_non_zero(
        server_factory: Callable[..., ServerProcess], untemplated_model: Path) -> None:
    server = server_factory(untemplated_model, "--max-model-len", "1024")
    no_template = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                             json={"messages": [{"role": "user", "content": "w5"}]})
    assert no_template.status_code == 400
    assert "no chat template" in no_template.json()["error"]["message"]
    asyncio.run(_check_death(server))
    assert server.proc.wait(timeout=10) != 0
    assert "engine dead" in server.log()


async def _check_death(server: ServerProcess) -> None:
    url = server.url
    streams = [asyncio.create_task(_stream(url, _long_body(1000))) for _ in range(2)]

    async def whole() -> tuple[int, float]:
        start = time.monotonic()
        async with httpx.AsyncClient(timeout=60) as client:
            response = await client.post(f"{url}/v1/completions", json={
                "prompt": "w7", "max_tokens": 1000, "ignore_eos": True})
        return response.status_code, time.monotonic() - start

    plain = asyncio.create_task(whole())
    await _until(lambda: server.metric("vllm:num_requests_running") == 3)
    killed_at = time.monotonic()
    os.kill(server.engine_pid(), signal.SIGKILL)
    for status, lines, _ in await asyncio.gather(*streams):
        assert status == 200
        errors = [json.loads(x[6:]) for x in lines if '"error"' in x]
        assert errors and "engine" in errors[0]["error"]["message"]
        assert lines[-1] == "data: [DONE]"
    status, _ = await plain
    assert status == 503
    assert time.monotonic() - killed_at < 5.0
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            health = (await client.get(f"{url}/health")).status_code
    except httpx.HTTPError:
        health = None  # already exited
    assert health != 200


@pytest.mark.parametrize(("flags", "words", "code"), [
    # Refused once the model is known to have no encoder (the core says so as it loads).
    (["--role", "encoder", "--kv-transfer-insecure"], "encoder-decoder model", 1),
    # Parallel engines overlap microbatches instead of scheduling asynchronously.
    (["--tensor-parallel-size", "2", "--async-scheduling"], "--async-scheduling with", 2),
])
def test_unsupported_command_lines_exit_at_once(flags: list[str], words: str, code: int) -> None:
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "kvferry.cli", "serve", "--model", "demo", *flags],
        capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == code, result.stderr[-2000:]
    assert words in result.stderr
    assert time.monotonic() - start < 30
