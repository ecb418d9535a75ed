"""The transfer key between real `kvferry serve` processes: forged params reach nothing,
the side channel serves only the service, a slow producer slows no one else.

An attacker here can send any request to a decode pod and run listeners of its own; it
does not hold the service's key (the tests do, standing in for the service's pods).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from kvferry.kvtransfer.auth import KEY_ENV, SideChannelAuth, TransferKey, sign_params
from kvferry.kvtransfer.params import KVTransferParams, prompt_hash
from kvferry.kvtransfer.side_channel import HandshakeInfo, SideChannelClient, SideChannelError
from kvferry_testing.keys import KEYED_ENV, TEST_KEY, TEST_KEY_TEXT
from kvferry_testing.listeners import FakeSideChannel, SilentListener
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

OTHER_KEY = TransferKey(b"another-service-transfer-key-0123456789")


def fallbacks(server: ServerProcess) -> float:
    return server.metric("kvferry:kv_transfer_fallbacks_total")


def signed(params: dict[str, Any], key: TransferKey = TEST_KEY, now: float | None = None,
           **changes: Any) -> dict[str, Any]:
    parsed = KVTransferParams.from_dict({**params, **changes})
    assert parsed is not None
    return sign_params(parsed, key, time.time() if now is None else now).to_dict()


def producer_client(params: dict[str, Any], reader: str,
                    key: TransferKey | None = TEST_KEY) -> SideChannelClient:
    """A client of the side channel the params name, holding `key`."""
    return SideChannelClient(params["remote_host"], params["remote_port"], timeout_s=5.0,
                             reader=reader, auth=None if key is None else SideChannelAuth(key))


@pytest.fixture(scope="module")
def strict_decode(server_factory: Callable[..., ServerProcess], tiny_model: Path) -> ServerProcess:
    """A decode pod of the same service whose failure policy is `fail`."""
    return start_role(server_factory, tiny_model, "decode", "--kv-failure-policy", "fail")


# ---------------------------------------------------------------------------- forged params
def forge(params: dict[str, Any], how: str, **changes: Any) -> dict[str, Any]:
    """The params with `changes`, their MAC left as it was, dropped, or made with
    another service's key."""
    forged = {**params, **changes}
    if how == "no mac":
        forged.pop("kvferry_mac")
    elif how == "another key":
        forged = signed(forged, key=OTHER_KEY)
    return forged


@pytest.fixture
def fake_producer(trio: Trio) -> Iterator[tuple[FakeSideChannel, dict[str, Any]]]:
    """A fake side channel replaying the real producer's handshake (as an attacker who once
    read it would), claiming to hold the blocks of a real prefill of another prompt; and the
    real params of that prefill."""
    victim = held_params(trio.prefill, prompt_of(3 * BLOCK_SIZE + 5, 101))
    info = producer_client(victim, "decode-x").handshake()
    remote_ids = victim["remote_block_ids"]
    fake = FakeSideChannel(msgspec.msgpack.encode(info), info.agent_name, [remote_ids])
    yield fake, victim
    fake.close()


@pytest.mark.parametrize("how", ["mac copied", "no mac", "another key"])
def test_forged_params_naming_a_fake_side_channel_pull_nothing_and_contact_nothing(
    trio: Trio, fake_producer: tuple[FakeSideChannel, dict[str, Any]], how: str,
) -> None:
    """The attack: another prompt's held blocks, the target prompt's hash, and the address
    of a fake side channel that says "held" to everything. Nothing is pulled, nothing is
    cached from it, and the decode pod never connects to the fake."""
    fake, victim = fake_producer
    target = prompt_of(3 * BLOCK_SIZE + 5, 102)
    expected = text_of(complete(trio.colocated, target, MAX_TOKENS))
    forged = forge(victim, how, remote_host="127.0.0.1", remote_port=fake.port,
                   kvferry_prompt_hash=prompt_hash(target[:victim["kvferry_num_tokens"]]))
    pulled, refused = bytes_pulled(trio.decode), failures(trio.decode, "bad_signature")
    recomputed = fallbacks(trio.decode)

    assert text_of(complete(trio.decode, target, MAX_TOKENS, forged)) == expected

    assert fake.num_accepted == 0
    assert bytes_pulled(trio.decode) == pulled
    assert failures(trio.decode, "bad_signature") == refused + 1
    assert fallbacks(trio.decode) == recomputed + 1
    # What the pod cached for the target prompt is its own KV: clean requests agree.
    assert text_of(complete(trio.decode, target, MAX_TOKENS)) == expected
    # No heartbeat or free went out later either.
    time.sleep(2.0)
    assert fake.num_accepted == 0


@pytest.mark.parametrize("stream", [False, True])
def test_under_policy_fail_forged_params_are_a_400_before_any_connection(
    trio: Trio, strict_decode: ServerProcess,
    fake_producer: tuple[FakeSideChannel, dict[str, Any]], stream: bool,
) -> None:
    fake, victim = fake_producer
    target = prompt_of(3 * BLOCK_SIZE + 5, 103)
    forged = forge(victim, "mac copied", remote_port=fake.port)
    refused = failures(strict_decode, "bad_signature")
    body = {"model": "tiny", "prompt": target, "max_tokens": MAX_TOKENS, "stream": stream,
            "kv_transfer_params": forged}
    response = httpx.post(f"{strict_decode.url}/v1/completions", json=body,
                          timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "kv_transfer_params"
    assert error["message"].startswith("kv_transfer_params.kvferry_mac does not match")
    assert fake.num_accepted == 0
    assert failures(strict_decode, "bad_signature") == refused + 1


def test_expired_params_are_refused_and_counted(trio: Trio, strict_decode: ServerProcess) -> None:
    prompt = prompt_of(2 * BLOCK_SIZE + 3, 104)
    params = held_params(trio.prefill, prompt)
    stale = signed(params, now=time.time() - 120)  # signed by the key, two minutes ago
    expired = failures(trio.decode, "params_expired")
    expected = text_of(complete(trio.colocated, prompt, MAX_TOKENS))
    assert text_of(complete(trio.decode, prompt, MAX_TOKENS, stale)) == expected
    assert failures(trio.decode, "params_expired") == expired + 1
    response = complete(strict_decode, prompt, MAX_TOKENS, stale)
    assert response.status_code == 400 and "expired" in response.json()["error"]["message"]


# ---------------------------------------------------------------------------- SSRF
@pytest.mark.parametrize("cached", [False, True], ids=["pull", "free"])
def test_params_naming_any_listener_make_no_connection_to_it(trio: Trio, cached: bool) -> None:
    """Crafted params (no signature) naming an internal address: the decode pod neither
    handshakes with it, renews, nor frees there. `free`: the prompt is all in the decode
    pod's prefix cache, so all it would do is tell the named address to free its hold."""
    prompt = prompt_of(4 * BLOCK_SIZE + 1, 110 + cached)
    if cached:
        text_of(complete(trio.decode, prompt, 1))
    listener = SilentListener()
    try:
        crafted = {"do_remote_prefill": True, "remote_engine_id": "internal",
                   "remote_host": "127.0.0.1", "remote_port": listener.port,
                   "remote_block_ids": [1, 2, 3, 4, 5], "remote_request_id": "x",
                   "kvferry_num_tokens": len(prompt)}
        for stream in (False, True):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": stream,
                    "kv_transfer_params": crafted}
            response = httpx.post(f"{trio.decode.url}/v1/completions", json=body,
                                  timeout=REQUEST_TIMEOUT_S)
            assert response.status_code == 200, response.text
        time.sleep(2.0)  # a heartbeat (every lease / 3) or a free would have gone out
        assert listener.num_accepted == 0
    finally:
        listener.close()


# ---------------------------------------------------------------------------- slow producer
async def _post_all(url: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120.0) as client:
        return await asyncio.gather(*(client.post(url, json=b) for b in bodies))


def test_a_silent_producer_does_not_slow_a_decode_hop_to_a_live_one(trio: Trio) -> None:
    """Sixteen requests whose params are correctly signed but name a producer that never
    answers: a decode hop to the live producer meanwhile takes at most 1 s longer than
    alone."""
    alone = []
    for i in range(3):
        prompt = prompt_of(3 * BLOCK_SIZE + 1, 120 + i)
        params = held_params(trio.prefill, prompt)
        started = time.monotonic()
        text_of(complete(trio.decode, prompt, 2, params))
        alone.append(time.monotonic() - started)
    silent = SilentListener()
    loop_thread_result: list[list[httpx.Response]] = []
    try:
        stuck = []
        for i in range(16):
            prompt = prompt_of(2 * BLOCK_SIZE + 1, 130 + i)
            params = held_params(trio.prefill, prompt)
            stuck.append({"model": "tiny", "prompt": prompt, "max_tokens": 2,
                          "kv_transfer_params": signed(params, remote_port=silent.port)})
        sender = threading.Thread(target=lambda: loop_thread_result.append(
            asyncio.run(_post_all(f"{trio.decode.url}/v1/completions", stuck))))
        sender.start()
        assert wait_for(lambda: silent.num_accepted >= 1, 10)
        prompt = prompt_of(3 * BLOCK_SIZE + 1, 150)
        params = held_params(trio.prefill, prompt)
        started = time.monotonic()
        text = text_of(complete(trio.decode, prompt, 2, params))
        took = time.monotonic() - started
        assert took < sorted(alone)[1] + 1.0, (took, alone)
        assert text == text_of(complete(trio.colocated, prompt, 2))
        # The silent producer holds at most two of the decode pod's pull preparations at a
        # time, and one heartbeat (every lease / 3, one call for all of its requests).
        assert silent.most_open <= 3
    finally:
        # Closing it fails the calls that wait on it: the stuck requests are computed here.
        silent.close()
    sender.join(60)
    assert [r.status_code for r in loop_thread_result[0]] == [200] * 16
    assert wait_for(lambda: used_blocks(trio.decode) == 0.0)


# ---------------------------------------------------------------------------- side channel
def test_the_side_channel_serves_only_the_service_and_each_hold_only_its_reader(
    trio: Trio,
) -> None:
    params = held_params(trio.prefill, prompt_of(2 * BLOCK_SIZE + 1, 160))
    agent, req_id = params["kvferry_agent_name"], params["remote_request_id"]
    held = trio.prefill.metric("kvferry:kv_blocks_held_for_transfer")
    # Without the key: nothing, not even the handshake.
    for key in (None, OTHER_KEY):
        with pytest.raises(SideChannelError, match="refused this consumer's signature"):
            producer_client(params, "decode-a", key).handshake()
    # With the key, a renewal or free that names no reader is refused.
    for call in ("renew", "free"):
        with pytest.raises(SideChannelError, match="400.*reader must name the consumer"):
            getattr(producer_client(params, ""), call)(agent, [req_id])
    # Reader a claims the hold; reader b can neither renew nor free it.
    reader_a, reader_b = producer_client(params, "decode-a"), producer_client(params, "decode-b")
    assert reader_a.renew(agent, [req_id]).held == [True]
    assert reader_b.renew(agent, [req_id]).held == [False]
    assert reader_b.free(agent, [req_id]).held == [False]
    assert trio.prefill.metric("kvferry:kv_blocks_held_for_transfer") == held
    assert reader_a.free(agent, [req_id]).held == [True]
    assert wait_for(lambda: trio.prefill.metric("kvferry:kv_blocks_held_for_transfer")
                    == held - len(params["remote_block_ids"]))
    assert isinstance(reader_a.handshake(), HandshakeInfo)


def test_a_decode_pod_refuses_a_prefill_hop(trio: Trio) -> None:
    response = complete(trio.decode, prompt_of(BLOCK_SIZE + 3, 170), 1, {"do_remote_decode": True})
    assert response.status_code == 400
    assert "this is a decode pod" in response.json()["error"]["message"]
    assert trio.decode.metric("kvferry:kv_blocks_held_for_transfer") == 0


def test_the_key_is_in_no_log_and_on_no_command_line(trio: Trio) -> None:
    prefill_then_decode(trio, prompt_of(BLOCK_SIZE + 2, 180))
    for server in (trio.prefill, trio.decode):
        assert TEST_KEY_TEXT not in server.log()
        cmdline = Path(f"/proc/{server.engine_pid()}/cmdline").read_bytes()
        # The engine core gets its config on the command line, its key by environment.
        assert b'"transfer_key":null' in cmdline and TEST_KEY_TEXT.encode() not in cmdline


# ---------------------------------------------------------------------------- no key, insecure
def test_a_pod_without_a_key_refuses_params_naming_the_fix(
    server_factory: Callable[..., ServerProcess], tiny_model: Path, trio: Trio,
) -> None:
    keyless = server_factory(tiny_model, "--role", "decode", "--block-size", str(BLOCK_SIZE),
                             "--served-model-name", "tiny", env={KEY_ENV: ""})
    prompt = prompt_of(2 * BLOCK_SIZE + 1, 190)
    for params in ({"do_remote_decode": True}, held_params(trio.prefill, prompt)):
        for stream in (False, True):
            response = httpx.post(f"{keyless.url}/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": stream,
                "kv_transfer_params": params}, timeout=REQUEST_TIMEOUT_S)
            assert response.status_code == 400
            message = response.json()["error"]["message"]
            assert "this pod has no KV transfer key" in message
            assert "--kv-transfer-key-file" in message and KEY_ENV in message
    assert "no KV transfer key: this decode pod starts no KV connector" in keyless.log()
    # Requests without params are served as usual.
    assert text_of(complete(keyless, prompt, 2)) == text_of(complete(trio.colocated, prompt, 2))


def test_insecure_pods_transfer_as_without_keys(
    server_factory: Callable[..., ServerProcess], tiny_model: Path, trio: Trio,
) -> None:
    prefill, decode = (
        server_factory(tiny_model, "--role", role, "--block-size", str(BLOCK_SIZE),
                       "--served-model-name", "tiny", "--kv-transfer-insecure", env={KEY_ENV: ""})
        for role in ("prefill", "decode"))
    prompt = prompt_of(3 * BLOCK_SIZE + 2, 200)
    text, params = prefill_then_decode(Trio(prefill, decode, trio.colocated), prompt)
    assert text == text_of(complete(trio.colocated, prompt, MAX_TOKENS))
    assert "kvferry_mac" not in params
    # Every prompt token but the last came over NIXL.
    assert bytes_pulled(decode) == 4 * BLOCK_BYTES
    assert "--kv-transfer-insecure: KV transfer params are neither signed" in decode.log()
    # A keyed pod takes no unsigned params from them.
    refused = failures(trio.decode, "bad_signature")
    params = held_params(prefill, prompt)
    assert text_of(complete(trio.decode, prompt, MAX_TOKENS, params)) == text
    assert failures(trio.decode, "bad_signature") == refused + 1


def test_a_keyed_pod_refuses_the_insecure_flag(
    server_factory: Callable[..., ServerProcess], tiny_model: Path,
) -> None:
    server = server_factory(tiny_model, "--role", "decode", "--kv-transfer-insecure",
                            env=KEYED_ENV, wait=False)
    assert server.proc.wait(60) == 2
    assert "--kv-transfer-insecure and a KV transfer key" in server.log()
    assert TEST_KEY_TEXT not in server.log()
