"""The encoder pool over real processes and real NIXL: an encoder pod (`--role encoder`)
runs only the encoder and holds the cross-attention blocks; a decode pod pulls them and
decodes. Answers equal a colocated pod's; the same input twice is not pulled again; forged
or mismatched params never put another input's KV under a request."""

from __future__ import annotations

import io
import json
import wave
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from kvferry_testing.encdec_checkpoints import make_bart_checkpoint, make_whisper_checkpoint
from kvferry_testing.holding_proxy import HoldingProxy
from kvferry_testing.keys import KEYED_ENV, resigned
from kvferry_testing.pd_pods import wait_for
from kvferry_testing.serve_helpers import ServerProcess

BLOCK_SIZE = 8
TIMEOUT_S = 60.0
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def bart(tmp_path_factory) -> Path:
    return make_bart_checkpoint(tmp_path_factory.mktemp("bart-pool"), seed=7)


@pytest.fixture(scope="module")
def whisper(tmp_path_factory) -> Path:
    return make_whisper_checkpoint(tmp_path_factory.mktemp("whisper-pool"), seed=8)


def _pods(server_factory: Callable[..., ServerProcess], model: Path, *extra: str,
          policy: str = "recompute") -> dict[str, ServerProcess]:
    """An encoder pod and a decode pod sharing the tests' key (`extra`: more flags of
    theirs), and a colocated pod to compare with."""
    common = ("--block-size", str(BLOCK_SIZE), "--served-model-name", "m",
              "--max-model-len", "64")
    keyed = (*common, "--kv-lease-seconds", "5", "--kv-failure-policy", policy, *extra)
    return {
        "encoder": server_factory(model, "--role", "encoder", *keyed, env=KEYED_ENV),
        "decode": server_factory(model, "--role", "decode", *keyed, env=KEYED_ENV),
        "colocated": server_factory(model, *common),
    }


@pytest.fixture(scope="module")
def bart_pods(server_factory, bart) -> Iterator[dict[str, ServerProcess]]:
    pods = _pods(server_factory, bart)
    yield pods
    _stop(pods)


@pytest.fixture
def pods_of(server_factory) -> Iterator[Callable[..., dict[str, ServerProcess]]]:
    """_pods for one test, stopped when it ends."""
    started: list[dict[str, ServerProcess]] = []

    def start(model: Path, *extra: str, policy: str = "recompute") -> dict[str, ServerProcess]:
        started.append(_pods(server_factory, model, *extra, policy=policy))
        return started[-1]

    yield start
    for pods in started:
        _stop(pods)


def _stop(pods: dict[str, ServerProcess]) -> None:
    """Servers a test started go with it (the session's would not fit in memory)."""
    for server in pods.values():
        server.kill_group()


def complete(server: ServerProcess, prompt: str, params: dict[str, Any] | None = None,
             **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS,
                            "temperature": 0.0, "ignore_eos": True, **extra}
    if params is not None:
        body["kv_transfer_params"] = params
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=TIMEOUT_S)


def encode(server: ServerProcess, prompt: str) -> dict[str, Any]:
    response = complete(server, prompt, {"do_remote_decode": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["text"] == "" and body["choices"][0]["finish_reason"] == "stop"
    return body["kv_transfer_params"]


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def metric(server: ServerProcess, name: str) -> float:
    return sum(v for k, v in server.metrics().items() if k.split("{")[0] == name)


def settled(server: ServerProcess, name: str, predicate: Callable[[float], bool]) -> float:
    """The metric once `predicate` holds for it (a step's statistics reach /metrics just
    after its outputs reach the client); fails if it never does."""
    assert wait_for(lambda: predicate(metric(server, name))), (name, metric(server, name))
    return metric(server, name)


def test_bart_through_the_encoder_pod_equals_colocated(bart_pods) -> None:
    pods = bart_pods
    prompt = "the rain in spain falls mainly on the plain"
    expected = text(complete(pods["colocated"], prompt))
    params = encode(pods["encoder"], prompt)
    assert params["do_remote_prefill"] is True
    assert params["remote_block_ids"][0] == [] and params["remote_block_ids"][1]
    assert params["kvferry_num_tokens"] == 0 and params["kvferry_encoder_hash"]
    assert params["kvferry_mac"]  # signed with the service's key
    pulled_before = metric(pods["decode"], "kvferry:cross_attention_bytes_pulled_total")
    assert text(complete(pods["decode"], prompt, params)) == expected
    pulled = settled(pods["decode"], "kvferry:cross_attention_bytes_pulled_total",
                     lambda v: v > pulled_before) - pulled_before
    # The encoder pod ran its encoder; the decode pod did not.
    settled(pods["encoder"], "kvferry:encoder_tokens_total", lambda v: v > 0)
    assert metric(pods["decode"], "kvferry:encoder_tokens_total") == 0
    # The hold ends with the pull: the encoder pod's blocks are all free again.
    assert wait_for(lambda: metric(pods["encoder"], "kvferry:kv_blocks_held_for_transfer") == 0)

    # The same input again: the decode pod has its cross blocks cached and pulls nothing,
    # it frees the encoder pod's hold at once.
    again = encode(pods["encoder"], prompt)
    hits = metric(pods["decode"], "kvferry:cross_block_cache_hits_total")
    assert text(complete(pods["decode"], prompt, again)) == expected
    assert metric(pods["decode"], "kvferry:cross_attention_bytes_pulled_total") \
        - pulled_before == pulled
    settled(pods["decode"], "kvferry:cross_block_cache_hits_total", lambda v: v == hits + 1)
    assert wait_for(lambda: metric(pods["encoder"], "kvferry:kv_blocks_held_for_transfer") == 0)
    assert wait_for(lambda: metric(pods["decode"], "vllm:kv_cache_usage_perc") == 0)


def test_params_of_another_input_are_not_pulled(bart_pods) -> None:
    pods = bart_pods
    params = encode(pods["encoder"], "one input")
    other = "quite another input"
    expected = text(complete(pods["colocated"], other))
    pulled = metric(pods["decode"], "kvferry:cross_attention_bytes_pulled_total")
    encoded = metric(pods["decode"], "kvferry:encoder_tokens_total")
    # Policy recompute: the decode pod runs the encoder itself and answers correctly.
    assert text(complete(pods["decode"], other, params)) == expected
    assert metric(pods["decode"], "kvferry:cross_attention_bytes_pulled_total") == pulled
    settled(pods["decode"], "kvferry:encoder_tokens_total", lambda v: v > encoded)
    # Its hold was let go (not left to expire).
    assert wait_for(lambda: metric(pods["encoder"], "kvferry:kv_blocks_held_for_transfer") == 0)


def test_forged_encoder_params_are_refused(bart_pods) -> None:
    pods = bart_pods
    params = encode(pods["encoder"], "a forged hold")
    forged = {**params, "kvferry_encoder_hash": "00" * 32}
    expected = text(complete(pods["colocated"], "a forged hold"))
    # The MAC no longer verifies: nothing is contacted, the prompt is computed here.
    assert text(complete(pods["decode"], "a forged hold", forged)) == expected
    settled(pods["decode"], "kvferry:kv_transfer_failures_total", lambda v: v >= 1)
    assert wait_for(lambda: metric(pods["encoder"], "kvferry:kv_blocks_held_for_transfer") == 0,
                    timeout_s=15)


def test_an_encoder_pod_needs_an_encoder_decoder_model(server_factory, tiny_model) -> None:
    server = server_factory(tiny_model, "--role", "encoder", wait=False, env=KEYED_ENV)
    assert server.proc.wait(timeout=120) != 0
    assert "--role encoder serves the encoder of an encoder-decoder model" in server.log()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wav(samples: np.ndarray, rate: int = 16000) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buffer.getvalue()


def transcribe(server: ServerProcess, audio: bytes,
               params: dict[str, Any] | None = None) -> httpx.Response:
    data = {"model": "m", "temperature": "0"}
    if params is not None:
        data["kv_transfer_params"] = json.dumps(params)
    return httpx.post(f"{server.url}/v1/audio/transcriptions", data=data,
                      files={"file": ("a.wav", audio, "audio/wav")}, timeout=TIMEOUT_S)


def test_whisper_through_the_encoder_pod_equals_colocated(pods_of, whisper) -> None:
    pods = pods_of(whisper)
    rng = np.random.default_rng(3)
    t = np.arange(24000) / 16000
    audio = _wav(0.4 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(t.shape))
    expected = transcribe(pods["colocated"], audio)
    assert expected.status_code == 200, expected.text
    held = transcribe(pods["encoder"], audio, {"do_remote_decode": True})
    assert held.status_code == 200, held.text
    params = held.json()["kv_transfer_params"]
    assert params["kvferry_num_encoder_tokens"] == 100  # max_source_positions
    answer = transcribe(pods["decode"], audio, params)
    assert answer.status_code == 200, answer.text
    assert answer.json()["text"] == expected.json()["text"]
    settled(pods["decode"], "kvferry:cross_attention_bytes_pulled_total", lambda v: v > 0)
    assert metric(pods["decode"], "kvferry:encoder_tokens_total") == 0
    assert wait_for(lambda: metric(pods["encoder"], "kvferry:kv_blocks_held_for_transfer") == 0)


def test_an_unpulled_hold_ends_at_its_lease(bart_pods) -> None:
    # The decode hop never comes (its pod died after the encode): the encoder pod frees the
    # cross blocks when the lease (5 s) runs out.
    pods = bart_pods
    encode(pods["encoder"], "nobody pulls this one")
    assert metric(pods["encoder"], "kvferry:kv_blocks_held_for_transfer") > 0
    expired = metric(pods["encoder"], "kvferry:kv_lease_expirations_total")
    assert wait_for(lambda: metric(pods["encoder"], "kvferry:kv_blocks_held_for_transfer") == 0,
                    timeout_s=20)
    assert metric(pods["encoder"], "kvferry:kv_lease_expirations_total") == expired + 1
    assert metric(pods["encoder"], "vllm:kv_cache_usage_perc") == 0


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_the_encoder_pod_killed_before_the_pull(pods_of, bart, policy) -> None:
    pods = pods_of(bart, policy=policy)
    prompt = "its encoder pod dies before the pull"
    expected = text(complete(pods["colocated"], prompt))
    params = encode(pods["encoder"], prompt)
    core = pods["encoder"].engine_pid()
    pods["encoder"].kill_group()
    # Its engine core (which holds the blocks) is gone too, not merely signalled.
    assert wait_for(lambda: not _alive(core))
    response = complete(pods["decode"], prompt, params)
    if policy == "recompute":
        assert text(response) == expected
        settled(pods["decode"], "kvferry:kv_transfer_fallbacks_total", lambda v: v == 1)
        settled(pods["decode"], "kvferry:encoder_tokens_total", lambda v: v > 0)
    else:
        assert response.status_code >= 400 or \
            response.json()["choices"][0]["finish_reason"] == "error", response.text
    assert wait_for(lambda: metric(pods["decode"], "vllm:kv_cache_usage_perc") == 0)
    assert metric(pods["decode"], "kvferry:num_requests_waiting_for_remote_kv") == 0


def test_a_client_cancelling_during_the_pull_frees_both_sides(pods_of, bart) -> None:
    # A lease far longer than the test: only the decode pod's free can end the hold in time.
    pods = pods_of(bart, "--kv-lease-seconds", "60")
    prompt = "a client gives up while its cross blocks are on the way"
    params = encode(pods["encoder"], prompt)
    held = metric(pods["encoder"], "kvferry:kv_blocks_held_for_transfer")
    assert held == len(params["remote_block_ids"][1])
    with HoldingProxy(params["remote_port"]) as proxy:
        slow = resigned(params, remote_host="127.0.0.1", remote_port=proxy.port)
        body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True,
                "temperature": 0.0, "kv_transfer_params": slow}
        with httpx.Client(timeout=TIMEOUT_S) as client, client.stream(
                "POST", f"{pods['decode'].url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert wait_for(lambda: metric(pods["decode"],
                                           "kvferry:num_requests_waiting_for_remote_kv") == 1
                            and proxy.num_accepted >= 1)
            assert metric(pods["decode"], "vllm:kv_cache_usage_perc") > 0
        # Hung up while parked: the decode pod frees its cross blocks at once.
        assert wait_for(lambda: metric(pods["decode"],
                                       "kvferry:num_requests_waiting_for_remote_kv") == 0
                        and metric(pods["decode"], "vllm:kv_cache_usage_perc") == 0)
        assert metric(pods["encoder"], "kvferry:kv_blocks_held_for_transfer") == held
        proxy.release()
        # Its free, held so far, reaches the encoder pod long before the lease would end.
        assert wait_for(lambda: metric(pods["encoder"],
                                       "kvferry:kv_blocks_held_for_transfer") == 0)
    assert metric(pods["encoder"], "kvferry:kv_lease_expirations_total") == 0
    assert metric(pods["decode"], "kvferry:cross_attention_bytes_pulled_total") == 0
    # Both serve on.
    expected = text(complete(pods["colocated"], prompt))
    assert text(complete(pods["decode"], prompt, encode(pods["encoder"], prompt))) == expected
