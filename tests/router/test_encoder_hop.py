"""The router's encode hop for encoder-decoder models, against fake pods that follow the
contract (notes in router/encode.py): real processes, real Redis, the official client."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from kvferry_testing.procs import Proc, fake_engine, router_process

from kvferry.protocol.block_hash import encoder_input_key, encoder_token_payload, hash_cross_blocks

AUDIO = "/v1/audio/transcriptions"
# The audio service's upload cap (the router's flag): large enough for the files below.
AUDIO_CAP = 8 * 1024 * 1024
_files = itertools.count()


def url(proc: Proc) -> str:
    return f"http://127.0.0.1:{proc.port}"  # type: ignore[attr-defined]


def metric(router: Proc, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(url(router) + "/metrics").text.splitlines():
        if line.startswith((name + "{", name + " ")):
            sample, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in sample for k, v in labels.items()):
                total += float(value)
    return total


def received(pod: Proc) -> list[dict[str, Any]]:
    return httpx.get(url(pod) + "/fake/requests").json()  # type: ignore[no-any-return]


def set_behaviour(pod: Proc, behaviour: str) -> None:
    httpx.post(url(pod) + "/fake/behaviour", json={"behaviour": behaviour}).raise_for_status()


def wait_pools(router: Proc, expected: dict[str, list[str]]) -> None:
    deadline = time.monotonic() + 10
    pools = None
    while time.monotonic() < deadline:
        pools = httpx.get(url(router) + "/health").json()["pools"]
        if pools == expected:
            return
        time.sleep(0.05)
    raise AssertionError(f"pools {pools} != {expected}")


def publish_cross(pod: Proc, router: Proc, hashes: list[bytes]) -> None:
    """`pod` publishes that it holds these cross blocks; returns once the router has them."""
    name = "kvferry:router_kv_event_batches"
    before = metric(router, name)
    httpx.post(url(pod) + "/fake/cache",
               json={"cross_hashes": [h.hex() for h in hashes]}).raise_for_status()
    deadline = time.monotonic() + 10
    while metric(router, name) <= before:
        assert time.monotonic() < deadline, "the router never applied the KV event"
        time.sleep(0.02)


def audio_file() -> bytes:
    """Bytes no other test sent (the router does not decode them; the key is their hash)."""
    return f"RIFF-{next(_files)}-".encode() + os.urandom(64 * 1024)


def audio_key(data: bytes) -> bytes:
    return encoder_input_key("audio-file", hashlib.sha256(data).digest())


def tokens_key(token_ids: list[int]) -> bytes:
    return encoder_input_key("tokens", encoder_token_payload(token_ids))


def since(pod: Proc, before: int) -> list[dict[str, Any]]:
    return received(pod)[before:]


def counts(procs: dict[str, Proc]) -> dict[str, int]:
    """How many requests each fake pod still running has received."""
    return {name: len(received(p)) for name, p in procs.items()
            if name != "router" and p.proc.poll() is None}


# ---------------------------------------------------------------------------- Whisper-like
@pytest.fixture(scope="module")
def audio(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[dict[str, Proc]]:
    """An encoder pod and two decode pods of an audio model; prefix-aware decode routing."""
    tmp = tmp_path_factory.mktemp("encpool-audio")
    service, args = "encpool-audio", ("--encoder-input", "audio", "--max-encoder-len", "1500")
    procs: dict[str, Proc] = {}
    try:
        procs["encoder-0"] = fake_engine(tmp, redis_url, service, "encoder", "encoder-0",
                                         args=args)
        for name in ("decode-0", "decode-1"):
            procs[name] = fake_engine(tmp, redis_url, service, "decode", name, args=args)
        procs["router"] = router_process(tmp, redis_url, service, "--max-audio-body-bytes",
                                         str(AUDIO_CAP),
                                         env={"KVFERRY_ROUTING_DECODE": "prefix-aware"})
        wait_pools(procs["router"], {"decode": ["decode-0", "decode-1"],
                                     "encoder": ["encoder-0"]})
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def transcribe(router: Proc, data: bytes, **fields: str) -> httpx.Response:
    form = {"model": "whisper", **fields}
    return httpx.post(url(router) + AUDIO, data=form, files={"file": ("a.wav", data, "audio/wav")},
                      timeout=10)


def test_a_transcription_goes_to_the_encoder_pod_then_to_decode_with_its_params(
        audio: dict[str, Proc]) -> None:
    router = audio["router"]
    before = counts(audio)
    hops = metric(router, "kvferry:router_encode_hops_total", endpoint=AUDIO)
    data = audio_file()
    answer = openai.OpenAI(base_url=url(router) + "/v1", api_key="none", max_retries=0) \
        .audio.transcriptions.create(model="whisper", file=("a.wav", data), language="en")
    assert answer.text == "a b c"
    sha = hashlib.sha256(data).hexdigest()
    [encoded] = since(audio["encoder-0"], before["encoder-0"])
    assert (encoded["file_sha256"], encoded["file_size"]) == (sha, len(data))
    assert json.loads(encoded["form"].pop("kv_transfer_params")) == {"do_remote_decode": True}
    assert encoded["form"] == {"model": "whisper", "language": "en"}
    assert encoded["content_type"].startswith("multipart/form-data; boundary=")
    [decoded] = [b for pod in ("decode-0", "decode-1") for b in since(audio[pod], before[pod])]
    params = json.loads(decoded["form"].pop("kv_transfer_params"))
    # The encoder pod's params as it gave them: its cross blocks and the input's key.
    assert (params["remote_engine_id"], params["remote_block_ids"]) == (
        "encoder-0", [[], list(range(1, 95))])
    assert params["kvferry_encoder_hash"] == audio_key(data).hex()
    assert decoded["form"] == encoded["form"] and decoded["file_sha256"] == sha
    assert metric(router, "kvferry:router_encode_hops_total", endpoint=AUDIO) == hops + 1
    assert metric(router, "kvferry:router_pod_chosen_total", pool="encoder") >= 1


def test_a_clients_own_transfer_params_never_reach_a_pod(audio: dict[str, Proc]) -> None:
    before = counts(audio)
    forged = json.dumps({"do_remote_prefill": True, "remote_host": "10.6.6.6"})
    response = transcribe(audio["router"], audio_file(), kv_transfer_params=forged,
                          response_format="text")
    assert (response.status_code, response.text) == (200, "a b c")
    [encoded] = since(audio["encoder-0"], before["encoder-0"])
    assert json.loads(encoded["form"]["kv_transfer_params"]) == {"do_remote_decode": True}
    [decoded] = [b for pod in ("decode-0", "decode-1") for b in since(audio[pod], before[pod])]
    assert json.loads(decoded["form"]["kv_transfer_params"])["remote_engine_id"] == "encoder-0"
    assert decoded["form"]["response_format"] == "text"


def test_the_encode_hop_is_skipped_for_a_file_whose_cross_blocks_a_decode_pod_holds(
        audio: dict[str, Proc]) -> None:
    router = audio["router"]
    data = audio_file()
    publish_cross(audio["decode-1"], router, hash_cross_blocks(audio_key(data), 94))
    skips = metric(router, "kvferry:router_encode_skips_total", reason="cached_on_decode")
    before = counts(audio)
    assert transcribe(router, data).json() == {"text": "a b c"}
    assert since(audio["encoder-0"], before["encoder-0"]) == []
    assert since(audio["decode-0"], before["decode-0"]) == []
    [decoded] = since(audio["decode-1"], before["decode-1"])
    assert "kv_transfer_params" not in decoded["form"]
    assert decoded["file_sha256"] == hashlib.sha256(data).hexdigest()
    assert metric(router, "kvferry:router_encode_skips_total",
                  reason="cached_on_decode") == skips + 1
    # Another file: no decode pod holds it, so it is encoded.
    transcribe(router, audio_file())
    assert len(since(audio["encoder-0"], before["encoder-0"])) == 1


@pytest.mark.parametrize("behaviour,reason", [
    ("busy", "encoder_refused"), ("refuse", "encoder_refused"), ("garbled", "encoder_failed")])
def test_an_encoder_pool_that_turns_the_hop_away_leaves_the_encoder_to_the_decode_pod(
        audio: dict[str, Proc], behaviour: str, reason: str) -> None:
    router = audio["router"]
    fallbacks = metric(router, "kvferry:router_encode_fallbacks_total", reason=reason)
    before = counts(audio)
    set_behaviour(audio["encoder-0"], behaviour)
    try:
        response = transcribe(router, audio_file())
    finally:
        set_behaviour(audio["encoder-0"], "ok")
    assert response.json() == {"text": "a b c"}
    [decoded] = [b for pod in ("decode-0", "decode-1") for b in since(audio[pod], before[pod])]
    assert "kv_transfer_params" not in decoded["form"]
    assert metric(router, "kvferry:router_encode_fallbacks_total",
                  reason=reason) == fallbacks + 1


def test_a_request_the_encoder_pod_finds_wrong_gets_its_answer(audio: dict[str, Proc]) -> None:
    before = counts(audio)
    set_behaviour(audio["encoder-0"], "invalid")
    try:
        response = transcribe(audio["router"], audio_file())
    finally:
        set_behaviour(audio["encoder-0"], "ok")
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "max_tokens: must be at most 16"
    assert [len(since(audio[p], before[p])) for p in ("decode-0", "decode-1")] == [0, 0]


def test_an_upload_over_the_cap_gets_413_whether_its_length_is_said_or_not(
        audio: dict[str, Proc]) -> None:
    router = audio["router"]
    before = counts(audio)
    big = b"\0" * (AUDIO_CAP + 1)
    said = transcribe(router, big)
    assert said.status_code == 413
    assert said.json()["error"]["message"] == (
        f"the request body is larger than {AUDIO_CAP} bytes (--max-audio-body-bytes)")

    def chunks() -> Iterator[bytes]:
        for _ in range(9):
            yield b"\0" * (1024 * 1024)

    streamed = httpx.post(url(router) + AUDIO, content=chunks(), timeout=10,
                          headers={"content-type": "multipart/form-data; boundary=x"})
    assert streamed.status_code == 413, streamed.text
    assert counts(audio) == before


def test_a_large_upload_reaches_both_pods_intact(audio: dict[str, Proc]) -> None:
    before = counts(audio)
    data = os.urandom(AUDIO_CAP - 64 * 1024)
    assert transcribe(audio["router"], data).json() == {"text": "a b c"}
    sha = hashlib.sha256(data).hexdigest()
    [encoded] = since(audio["encoder-0"], before["encoder-0"])
    [decoded] = [b for pod in ("decode-0", "decode-1") for b in since(audio[pod], before[pod])]
    assert encoded["file_sha256"] == decoded["file_sha256"] == sha


def test_a_body_that_is_no_form_goes_to_a_decode_pod_as_sent(audio: dict[str, Proc]) -> None:
    before = counts(audio)
    response = httpx.post(url(audio["router"]) + AUDIO, json={"model": "whisper"}, timeout=10)
    # The fake pod refuses it as the engine's route does (Starlette finds no form).
    assert response.status_code == 400
    assert since(audio["encoder-0"], before["encoder-0"]) == []


def test_without_a_live_encoder_pod_the_decode_pod_encodes(audio: dict[str, Proc]) -> None:
    """Last in the module: it stops the encoder pod."""
    router = audio["router"]
    audio["encoder-0"].stop()
    wait_pools(router, {"decode": ["decode-0", "decode-1"]})
    fallbacks = metric(router, "kvferry:router_encode_fallbacks_total",
                       reason="no_live_encoder_pod")
    before = counts(audio)
    assert transcribe(router, audio_file()).json() == {"text": "a b c"}
    [decoded] = [b for pod in ("decode-0", "decode-1") for b in since(audio[pod], before[pod])]
    assert "kv_transfer_params" not in decoded["form"]
    assert metric(router, "kvferry:router_encode_fallbacks_total",
                  reason="no_live_encoder_pod") == fallbacks + 1


# ---------------------------------------------------------------------------- a prefill pool
def three_pools(tmp: Path, redis_url: str, service: str, encoder_input: str,
                max_encoder_len: int, *router_flags: str) -> Iterator[dict[str, Proc]]:
    """An encoder, a prefill and a decode pod of an encoder-decoder model, and the router."""
    args = ("--encoder-input", encoder_input, "--max-encoder-len", str(max_encoder_len))
    procs: dict[str, Proc] = {}
    try:
        for role, name in (("encoder", "encoder-0"), ("prefill", "prefill-0"),
                           ("decode", "decode-0")):
            procs[name] = fake_engine(tmp, redis_url, service, role, name, args=args)
        procs["router"] = router_process(tmp, redis_url, service, *router_flags)
        wait_pools(procs["router"], {"decode": ["decode-0"], "encoder": ["encoder-0"],
                                     "prefill": ["prefill-0"]})
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="module")
def audio_prefill(tmp_path_factory: pytest.TempPathFactory,
                  redis_url: str) -> Iterator[dict[str, Proc]]:
    """An audio model's three pools; the prefill threshold 64 tokens (the fake's /tokenize
    gives one token per word)."""
    yield from three_pools(tmp_path_factory.mktemp("encpool-prefill"), redis_url,
                           "encpool-prefill", "audio", 1500, "--prefill-threshold", "64")


LONG_PROMPT = " ".join(["earlier"] * 80)  # 80 words: 80 tokens by the fake's /tokenize


def test_a_long_previous_text_takes_encoder_then_prefill_then_decode(
        audio_prefill: dict[str, Proc]) -> None:
    procs = audio_prefill
    router = procs["router"]
    before = counts(procs)
    data = audio_file()
    response = transcribe(router, data, prompt=LONG_PROMPT, stream="true")
    assert response.status_code == 200, response.text
    [encoded] = since(procs["encoder-0"], before["encoder-0"])
    assert json.loads(encoded["form"]["kv_transfer_params"]) == {"do_remote_decode": True}
    # The prefill pod gets the encoder pod's params, asked to hold what it computes.
    [prefilled] = since(procs["prefill-0"], before["prefill-0"])
    sent = json.loads(prefilled["form"].pop("kv_transfer_params"))
    assert sent.pop("do_remote_decode") is True
    assert (sent["remote_engine_id"], sent["remote_block_ids"][0]) == ("encoder-0", [])
    assert prefilled["form"]["prompt"] == LONG_PROMPT
    assert prefilled["file_sha256"] == hashlib.sha256(data).hexdigest()
    # The decode pod gets the prefill pod's: both block groups.
    [decoded] = since(procs["decode-0"], before["decode-0"])
    params = json.loads(decoded["form"].pop("kv_transfer_params"))
    assert (params["remote_engine_id"], params["remote_block_ids"][0]) == ("prefill-0", [1, 2, 3])
    assert params["kvferry_encoder_hash"] == audio_key(data).hex()
    assert decoded["form"] == {**prefilled["form"]}
    assert metric(router, "kvferry:router_pod_chosen_total", pool="prefill") >= 1


def test_a_short_previous_text_skips_the_prefill_pool(audio_prefill: dict[str, Proc]) -> None:
    procs = audio_prefill
    router = procs["router"]
    skips = metric(router, "kvferry:router_prefill_skips_total", reason="short_prompt")
    before = counts(procs)
    # 40 words with bytes enough to be tokenized: short by the tokenizer, not by bytes.
    for prompt in ("a few words", " ".join(["earlier"] * 40)):
        assert transcribe(router, audio_file(), prompt=prompt).json() == {"text": "a b c"}
    assert since(procs["prefill-0"], before["prefill-0"]) == []
    for decoded in since(procs["decode-0"], before["decode-0"]):
        params = json.loads(decoded["form"]["kv_transfer_params"])
        assert params["remote_engine_id"] == "encoder-0"
    assert metric(router, "kvferry:router_prefill_skips_total",
                  reason="short_prompt") == skips + 2


@pytest.mark.parametrize("behaviour,keeps_encoder_hold", [("refuse", True), ("garbled", False)])
def test_a_failing_prefill_pod_leaves_the_decoder_prompt_to_the_decode_pod(
        audio_prefill: dict[str, Proc], behaviour: str, keeps_encoder_hold: bool) -> None:
    """A pod that turned the hop away pulled nothing: the encoder pod's params go on. One
    that failed after taking it may have pulled them: the decode pod encodes itself."""
    procs = audio_prefill
    router = procs["router"]
    fallbacks = metric(router, "kvferry:router_prefill_fallbacks_total", reason="prefill_failed")
    before = counts(procs)
    set_behaviour(procs["prefill-0"], behaviour)
    try:
        response = transcribe(router, audio_file(), prompt=LONG_PROMPT)
    finally:
        set_behaviour(procs["prefill-0"], "ok")
    assert response.json() == {"text": "a b c"}
    [decoded] = since(procs["decode-0"], before["decode-0"])
    if keeps_encoder_hold:
        params = json.loads(decoded["form"]["kv_transfer_params"])
        assert params["remote_engine_id"] == "encoder-0"
    else:
        assert "kv_transfer_params" not in decoded["form"]
    assert metric(router, "kvferry:router_prefill_fallbacks_total",
                  reason="prefill_failed") == fallbacks + 1


def test_without_an_encoder_hop_the_prefill_pod_encodes(audio_prefill: dict[str, Proc]) -> None:
    procs = audio_prefill
    router = procs["router"]
    set_behaviour(procs["encoder-0"], "refuse")
    before = counts(procs)
    try:
        assert transcribe(router, audio_file(), prompt=LONG_PROMPT).json() == {"text": "a b c"}
    finally:
        set_behaviour(procs["encoder-0"], "ok")
    [prefilled] = since(procs["prefill-0"], before["prefill-0"])
    assert json.loads(prefilled["form"]["kv_transfer_params"]) == {"do_remote_decode": True}
    [decoded] = since(procs["decode-0"], before["decode-0"])
    assert json.loads(decoded["form"]["kv_transfer_params"])["remote_engine_id"] == "prefill-0"


def test_a_prefill_pod_that_refuses_the_connection_leaves_the_encoder_hold_standing(
        audio_prefill: dict[str, Proc]) -> None:
    """Last of the prefill-pool tests: it kills the prefill pod (its registry record
    stays). Its connection refused, it took nothing: the decode pod gets the encoder
    pod's params (a pod that took the hop and failed would not leave them: see above)."""
    procs = audio_prefill
    router = procs["router"]
    procs["prefill-0"].proc.kill()
    procs["prefill-0"].proc.wait()
    before = counts(procs)
    assert transcribe(router, audio_file(), prompt=LONG_PROMPT).json() == {"text": "a b c"}
    [decoded] = since(procs["decode-0"], before["decode-0"])
    params = json.loads(decoded["form"]["kv_transfer_params"])
    assert params["remote_engine_id"] == "encoder-0"


# ---------------------------------------------------------------------------- BART-like
@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[dict[str, Proc]]:
    """A token encoder's three pools; the router asks the pods' /tokenize (the fake's token
    ids are its words' lengths)."""
    yield from three_pools(tmp_path_factory.mktemp("encpool-tokens"), redis_url,
                           "encpool-tokens", "tokens", 1024)


def complete(router: Proc, **body: Any) -> httpx.Response:
    return httpx.post(url(router) + "/v1/completions", json={"model": "bart", **body},
                      timeout=10)


@pytest.mark.parametrize("stream", [False, True])
def test_a_completion_takes_the_encode_hop_and_never_the_prefill_pool(
        tokens: dict[str, Proc], stream: bool) -> None:
    router = tokens["router"]
    before = counts(tokens)
    skips = metric(router, "kvferry:router_prefill_skips_total", reason="encoder_decoder")
    prompt = " ".join(["summarize"] * 400)  # far past the prefill threshold
    response = complete(router, prompt=prompt, max_tokens=3, stream=stream,
                        stream_options={"include_usage": True} if stream else None)
    assert response.status_code == 200, response.text
    [encoded] = since(tokens["encoder-0"], before["encoder-0"])
    assert encoded["kv_transfer_params"] == {"do_remote_decode": True}
    assert encoded["stream"] is False and "stream_options" not in encoded
    assert (encoded["prompt"], encoded["max_tokens"]) == (prompt, 3)
    [decoded] = since(tokens["decode-0"], before["decode-0"])
    assert decoded["stream"] is stream and decoded["prompt"] == prompt
    params = decoded["kv_transfer_params"]
    assert params["kvferry_encoder_hash"] == tokens_key([9] * 400).hex()
    assert params["remote_block_ids"] == [[], list(range(1, 26))]
    assert since(tokens["prefill-0"], before["prefill-0"]) == []
    assert metric(router, "kvferry:router_prefill_skips_total",
                  reason="encoder_decoder") == skips + 1


@pytest.mark.parametrize("prompt,token_ids", [
    ("the cross blocks are held", [3, 5, 6, 3, 4]), ([17, 4, 9], [17, 4, 9])])
def test_a_prompt_whose_cross_blocks_the_decode_pod_holds_skips_the_encoder(
        tokens: dict[str, Proc], prompt: Any, token_ids: list[int]) -> None:
    """Text is keyed by the ids the pods' tokenizer gives it, ids as given."""
    router = tokens["router"]
    publish_cross(tokens["decode-0"], router, hash_cross_blocks(tokens_key(token_ids), 1))
    before = counts(tokens)
    assert complete(router, prompt=prompt, max_tokens=2).status_code == 200
    assert since(tokens["encoder-0"], before["encoder-0"]) == []
    [decoded] = since(tokens["decode-0"], before["decode-0"])
    assert decoded["prompt"] == prompt and "kv_transfer_params" not in decoded
    assert metric(router, "kvferry:router_encode_skips_total", reason="cached_on_decode") >= 1


def test_a_batch_goes_straight_to_decode(tokens: dict[str, Proc]) -> None:
    router = tokens["router"]
    skips = metric(router, "kvferry:router_encode_skips_total", reason="not_one_prompt")
    before = counts(tokens)
    assert complete(router, prompt=["one text", "another text"], max_tokens=2).status_code == 200
    assert since(tokens["encoder-0"], before["encoder-0"]) == []
    [decoded] = since(tokens["decode-0"], before["decode-0"])
    assert "kv_transfer_params" not in decoded
    assert metric(router, "kvferry:router_encode_skips_total",
                  reason="not_one_prompt") == skips + 1
