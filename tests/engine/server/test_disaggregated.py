"""Prefill/decode disaggregation between real `kvferry serve` processes over NIXL.

A prefill server (`--role prefill`) computes a prompt and holds its blocks; a decode
server (`--role decode`) pulls them over NIXL on loopback and decodes. Greedy outputs must
equal a colocated server's token for token, and every block taken must come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvferry_testing.holding_proxy import HoldingProxy
from kvferry_testing.keys import KEYED_ENV, resigned
from kvferry_testing.pd_pods import (
    BLOCK_BYTES,
    BLOCK_SIZE,
    MAX_TOKENS,
    REQUEST_TIMEOUT_S,
    Trio,
    bytes_pulled,
    complete,
    failures,
    held_params,
    kill_pod,
    prefill_then_decode,
    prompt_of,
    start_role,
    text_of,
    used_blocks,
    wait_for,
)
from kvferry_testing.serve_helpers import ServerProcess

# Children inherit this; UCX logs a line per refused connection otherwise.
os.environ.setdefault("UCX_LOG_LEVEL", "fatal")


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


# ---------------------------------------------------------------------------- faults
def test_decode_gone_after_prefill_the_producer_frees_at_lease_end(
    server_factory: Callable[..., ServerProcess], tiny_model: Path,
) -> None:
    prefill = start_role(server_factory, tiny_model, "prefill", "--kv-lease-seconds", "1")
    decode = start_role(server_factory, tiny_model, "decode")
    held_params(prefill, prompt_of(3 * BLOCK_SIZE, 11))
    assert prefill.metric("kvferry:kv_blocks_held_for_transfer") == 3
    assert used_blocks(prefill) > 0
    kill_pod(decode)
    assert wait_for(lambda: used_blocks(prefill) == 0.0, 10)
    assert prefill.metric("kvferry:kv_lease_expirations_total") == 1
    assert prefill.metric("kvferry:kv_blocks_held_for_transfer") == 0


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_producer_killed_before_the_pull(
    server_factory: Callable[..., ServerProcess], tiny_model: Path, trio: Trio, policy: str,
) -> None:
    prefill = start_role(server_factory, tiny_model, "prefill")
    decode = start_role(server_factory, tiny_model, "decode", "--kv-failure-policy", policy)
    prompt = prompt_of(2 * BLOCK_SIZE + 3, 21)
    params = held_params(prefill, prompt)
    kill_pod(prefill)
    started = time.monotonic()
    response = complete(decode, prompt, MAX_TOKENS, params)
    assert time.monotonic() - started < 30
    assert failures(decode, "producer_unreachable") == 1
    if policy == "recompute":
        assert text_of(response) == text_of(complete(trio.colocated, prompt, MAX_TOKENS))
        assert decode.metric("kvferry:kv_transfer_fallbacks_total") == 1
    else:
        assert response.status_code == 502, response.text
        assert "producer_unreachable" in response.json()["error"]["message"]
        assert decode.metric("kvferry:kv_transfer_fallbacks_total") == 0
    assert wait_for(lambda: used_blocks(decode) == 0.0)


def test_mismatched_layout_is_refused_at_handshake(
    server_factory: Callable[..., ServerProcess], tiny_model: Path, trio: Trio,
) -> None:
    # Same model, other block size: the producer's layout cannot fill the decoder's blocks.
    prefill = server_factory(tiny_model, "--role", "prefill", "--block-size", "8",
                             "--served-model-name", "tiny", env=KEYED_ENV)
    prompt = prompt_of(2 * BLOCK_SIZE + 3, 31)
    params = held_params(prefill, prompt)
    before = failures(trio.decode, "incompatible")
    text = text_of(complete(trio.decode, prompt, MAX_TOKENS, params))
    assert text == text_of(complete(trio.colocated, prompt, MAX_TOKENS))
    assert failures(trio.decode, "incompatible") == before + 1
    # The decode side said it will not pull: the producer frees at once, not at lease end.
    assert wait_for(lambda: used_blocks(prefill) == 0.0, 3)
    assert wait_for(lambda: used_blocks(trio.decode) == 0.0)


def test_producer_restarted_on_the_same_port(
    server_factory: Callable[..., ServerProcess], tiny_model: Path, trio: Trio,
) -> None:
    from kvferry_testing.serve_helpers import free_port

    nixl_port = str(free_port())
    prefill = start_role(server_factory, tiny_model, "prefill", "--nixl-port", nixl_port)
    prompt = prompt_of(2 * BLOCK_SIZE + 3, 41)
    expected = text_of(complete(trio.colocated, prompt, MAX_TOKENS))
    stale = held_params(prefill, prompt)
    assert text_of(complete(trio.decode, prompt, MAX_TOKENS, stale)) == expected
    kill_pod(prefill)
    prefill = start_role(server_factory, tiny_model, "prefill", "--nixl-port", nixl_port)
    # Params of the dead incarnation: refused, recomputed, answered correctly.
    stale = resigned(stale, remote_request_id="gone")
    assert text_of(complete(trio.decode, prompt, MAX_TOKENS, stale)) == expected
    # The new incarnation is found through a fresh handshake.
    text, params = prefill_then_decode(Trio(prefill, trio.decode, trio.colocated), prompt)
    assert text == expected and params["remote_port"] == int(nixl_port)
    assert wait_for(lambda: used_blocks(prefill) == 0.0 and used_blocks(trio.decode) == 0.0)


# ---------------------------------------------------------------------------- load
async def _prefill_then_decode_async(client: httpx.AsyncClient, trio: Trio,
                                     prompt: list[int]) -> httpx.Response:
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "temperature": 0.0,
                            "ignore_eos": True}
    first = await client.post(f"{trio.prefill.url}/v1/completions", json={
        **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert first.status_code == 200, first.text
    return await client.post(f"{trio.decode.url}/v1/completions", json={
        **body, "max_tokens": 2, "kv_transfer_params": first.json()["kv_transfer_params"]})


def test_200_concurrent_prefill_then_decode_leak_no_block(trio: Trio) -> None:
    prompts = [prompt_of(17 + i % 40, 5000 + 13 * i) for i in range(200)]

    async def run_all() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=180.0, limits=limits) as client:
            return await asyncio.gather(
                *(_prefill_then_decode_async(client, trio, p) for p in prompts))

    responses = asyncio.run(run_all())
    assert [r.status_code for r in responses] == [200] * 200
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in responses)
    assert wait_for(lambda: used_blocks(trio.prefill) == 0.0 and used_blocks(trio.decode) == 0.0)
    assert trio.prefill.metric("kvferry:kv_blocks_held_for_transfer") == 0


def test_clients_cancelling_at_any_point_free_blocks_on_both_sides(trio: Trio) -> None:
    async def cancel_after(client: httpx.AsyncClient, prompt: list[int], delay_s: float) -> None:
        task = asyncio.ensure_future(_prefill_then_decode_async(client, trio, prompt))
        await asyncio.sleep(delay_s)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, AssertionError):
            await task

    async def run_all() -> None:
        async with httpx.AsyncClient(timeout=60.0) as client:
            await asyncio.gather(*(
                cancel_after(client, prompt_of(3 * BLOCK_SIZE + i, 7000 + 17 * i), 0.002 * i)
                for i in range(30)))

    asyncio.run(run_all())
    # Holds of prefills whose decode was never sent end at the 5 s lease at the latest.
    assert wait_for(lambda: used_blocks(trio.prefill) == 0.0 and used_blocks(trio.decode) == 0.0,
                    15)
    assert trio.prefill.metric("kvferry:kv_blocks_held_for_transfer") == 0


def waiting_for_remote_kv(server: ServerProcess) -> float:
    return server.metric("kvferry:num_requests_waiting_for_remote_kv")


def aborted(server: ServerProcess) -> float:
    return server.metrics()['vllm:request_success_total{finished_reason="abort",model_name="tiny"}']


def through(proxy: HoldingProxy, params: dict[str, Any]) -> dict[str, Any]:
    """The params with the producer's side channel reached through the proxy (signed again
    with the service's key, as the test holds it)."""
    return resigned(params, remote_host="127.0.0.1", remote_port=proxy.port)


@contextlib.contextmanager
def streamed_decode(server: ServerProcess, prompt: list[int],
                    params: dict[str, Any]) -> Any:
    """A streamed decode hop whose headers came back; leaving the block hangs up."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "kv_transfer_params": params}
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client, client.stream(
            "POST", f"{server.url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        yield response


def parked_behind(proxy: HoldingProxy, decode: ServerProcess, num_waiting: int = 1) -> bool:
    """The decode request waits for remote KV and its pull's side-channel call is held."""
    return wait_for(lambda: waiting_for_remote_kv(decode) == num_waiting
                    and proxy.num_accepted >= 1)


def test_a_client_hanging_up_during_the_pull_frees_blocks_on_both_sides(
    server_factory: Callable[..., ServerProcess], tiny_model: Path, trio: Trio,
) -> None:
    # A lease far longer than the test: only the consumer's free can end the hold in time.
    prefill = start_role(server_factory, tiny_model, "prefill", "--kv-lease-seconds", "60")
    prompt = prompt_of(3 * BLOCK_SIZE + 5, 71)
    start_prefill, start_decode = used_blocks(prefill), used_blocks(trio.decode)
    aborts, pulled = aborted(trio.decode), bytes_pulled(trio.decode)
    unreachable = failures(trio.decode, "producer_unreachable")
    params = held_params(prefill, prompt)
    with HoldingProxy(params["remote_port"]) as proxy:
        with streamed_decode(trio.decode, prompt, through(proxy, params)):
            assert parked_behind(proxy, trio.decode)
            assert used_blocks(trio.decode) > start_decode
        # Hung up while parked: the decode side frees its blocks without the producer.
        assert wait_for(lambda: aborted(trio.decode) == aborts + 1)
        assert wait_for(lambda: waiting_for_remote_kv(trio.decode) == 0
                        and used_blocks(trio.decode) == start_decode)
        assert prefill.metric("kvferry:kv_blocks_held_for_transfer") == 4
        proxy.release()
        # The consumer's free, held so far, reaches the producer: freed long before the lease.
        assert wait_for(lambda: prefill.metric("kvferry:kv_blocks_held_for_transfer") == 0)
        assert wait_for(lambda: used_blocks(prefill) == start_prefill)
    assert prefill.metric("kvferry:kv_lease_expirations_total") == 0
    # Cancelled, not failed: nothing was read, nothing counted as a failure.
    assert bytes_pulled(trio.decode) == pulled
    assert failures(trio.decode, "producer_unreachable") == unreachable
    # Both still serve.
    assert prefill_then_decode(Trio(prefill, trio.decode, trio.colocated), prompt)[0] == \
        text_of(complete(trio.colocated, prompt, MAX_TOKENS))


def test_decode_killed_during_its_pull_the_producer_frees_and_serves_on(
    server_factory: Callable[..., ServerProcess], tiny_model: Path, trio: Trio,
) -> None:
    prefill = start_role(server_factory, tiny_model, "prefill", "--kv-lease-seconds", "1")
    decode = start_role(server_factory, tiny_model, "decode")
    prompt = prompt_of(2 * BLOCK_SIZE + 7, 81)
    start = used_blocks(prefill)
    params = held_params(prefill, prompt)
    assert prefill.metric("kvferry:kv_blocks_held_for_transfer") == 3
    with HoldingProxy(params["remote_port"]) as proxy:
        with contextlib.suppress(httpx.HTTPError), \
                streamed_decode(decode, prompt, through(proxy, params)):
            assert parked_behind(proxy, decode)
            kill_pod(decode)
        # The calls the dead pod made are delivered late, renewals included.
        proxy.release()
        assert wait_for(lambda: used_blocks(prefill) == start)
    assert prefill.metric("kvferry:kv_blocks_held_for_transfer") == 0
    assert prefill.metric("kvferry:kv_lease_expirations_total") == 1
    expected = text_of(complete(trio.colocated, prompt, MAX_TOKENS))
    assert prefill_then_decode(Trio(prefill, trio.decode, trio.colocated), prompt)[0] == expected
    assert wait_for(lambda: used_blocks(prefill) == start)


def streamed_chunks(server: ServerProcess, path: str, body: dict[str, Any]) -> list[dict]:
    """Every data chunk of a streamed response, parsed."""
    chunks = []
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True},
                      timeout=REQUEST_TIMEOUT_S) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def params_of_stream(chunks: list[dict]) -> dict[str, Any]:
    """The params of a streamed prefill hop: on its finishing chunk, and only there."""
    carrying = [c for c in chunks if c.get("kv_transfer_params")]
    assert len(carrying) == 1, chunks
    assert carrying[0]["choices"][0]["finish_reason"] == "length"
    return carrying[0]["kv_transfer_params"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_streamed_prefill_hop_returns_the_params(trio: Trio, path: str) -> None:
    prompt = prompt_of(4 * BLOCK_SIZE + 9, 91)
    if path == "/v1/completions":
        body: dict[str, Any] = {"prompt": prompt}
    else:
        words = " ".join(f"w{t}" for t in prompt)
        body = {"messages": [{"role": "user", "content": words}]}
    body.update(model="tiny", temperature=0.0, ignore_eos=True)
    expected = httpx.post(f"{trio.colocated.url}{path}", json={**body, "max_tokens": MAX_TOKENS},
                          timeout=REQUEST_TIMEOUT_S)
    assert expected.status_code == 200, expected.text
    whole = httpx.post(f"{trio.prefill.url}{path}", json={
        **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        timeout=REQUEST_TIMEOUT_S).json()["kv_transfer_params"]
    params = params_of_stream(streamed_chunks(trio.prefill, path, {
        **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}))
    # The shape of the non-streamed response's params.
    assert set(params) == set(whole) and params["do_remote_prefill"] is True
    assert params["remote_request_id"] != whole["remote_request_id"]
    for hop_params in (params, whole):
        before = bytes_pulled(trio.decode)
        decoded = httpx.post(f"{trio.decode.url}{path}", json={
            **body, "max_tokens": MAX_TOKENS, "kv_transfer_params": hop_params},
            timeout=REQUEST_TIMEOUT_S)
        assert decoded.status_code == 200, decoded.text
        choice, wanted = decoded.json()["choices"][0], expected.json()["choices"][0]
        assert choice.get("text", choice.get("message")) == \
            wanted.get("text", wanted.get("message"))
        # The first hop pulls the blocks of every prompt token but the last; the second
        # finds the full ones in the decode pod's prefix cache and pulls the partial one.
        num_tokens = params["kvferry_num_tokens"] - 1
        num_blocks = -(-num_tokens // BLOCK_SIZE) if hop_params is params else 1
        assert num_tokens % BLOCK_SIZE
        assert bytes_pulled(trio.decode) - before == num_blocks * BLOCK_BYTES
    assert wait_for(lambda: used_blocks(trio.prefill) == 0.0 and used_blocks(trio.decode) == 0.0)
    assert trio.prefill.metric("kvferry:kv_blocks_held_for_transfer") == 0


# ---------------------------------------------------------------------------- roles
def test_role_both_with_kv_transfer_takes_either_kind_of_params(
    server_factory: Callable[..., ServerProcess], tiny_model: Path, trio: Trio,
) -> None:
    both = server_factory(tiny_model, "--block-size", str(BLOCK_SIZE), "--served-model-name",
                          "tiny", "--kv-transfer", env=KEYED_ENV)
    prompt = prompt_of(3 * BLOCK_SIZE + 2, 51)
    expected = text_of(complete(trio.colocated, prompt, MAX_TOKENS))
    # As the producer of the decode pod, then as the consumer of the prefill pod.
    assert prefill_then_decode(Trio(both, trio.decode, trio.colocated), prompt)[0] == expected
    assert prefill_then_decode(Trio(trio.prefill, both, trio.colocated), prompt)[0] == expected
    assert wait_for(lambda: used_blocks(both) == 0.0 and used_blocks(trio.prefill) == 0.0)


def test_params_without_kv_transfer_or_malformed_are_a_400(trio: Trio) -> None:
    response = complete(trio.colocated, [5, 6, 7], 1, {"do_remote_decode": True})
    assert response.status_code == 400 and "KV transfer" in response.text
    response = complete(trio.decode, [5, 6, 7], 1, {"do_remote_prefill": True})
    assert response.status_code == 400 and "remote_engine_id" in response.text


def test_a_streamed_decode_hop_pulls_too(trio: Trio) -> None:
    """vLLM's proxies stream the decode hop; chat takes the params the same way."""
    prompt = prompt_of(5 * BLOCK_SIZE + 1, 61)
    expected = text_of(complete(trio.colocated, prompt, MAX_TOKENS))
    params = held_params(trio.prefill, prompt)
    before = bytes_pulled(trio.decode)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "kv_transfer_params": params}
    text = ""
    with httpx.stream("POST", f"{trio.decode.url}/v1/completions", json=body,
                      timeout=REQUEST_TIMEOUT_S) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[len("data: "):])["choices"][0]["text"]
    assert text == expected
    assert bytes_pulled(trio.decode) - before == 5 * BLOCK_BYTES
    chat_params = held_params(trio.prefill, prompt)
    fallbacks = trio.decode.metric("kvferry:kv_transfer_fallbacks_total")
    chat = httpx.post(f"{trio.decode.url}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "kv_transfer_params": chat_params}, timeout=REQUEST_TIMEOUT_S)
    # The chat prompt is not the held prompt: KV computed for another prompt is never
    # pulled; the decode pod computes its own (a fallback) and the producer's hold is freed.
    assert chat.status_code == 200, chat.text
    assert trio.decode.metric("kvferry:kv_transfer_fallbacks_total") == fallbacks + 1
    assert bytes_pulled(trio.decode) - before == 5 * BLOCK_BYTES
    assert wait_for(lambda: used_blocks(trio.prefill) == 0.0 and used_blocks(trio.decode) == 0.0)
