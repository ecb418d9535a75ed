"""`kvferry up` of encoder-decoder services with an encoder pool, for real: encoder pods
(`--role encoder`), decode pods pulling their cross-attention blocks over NIXL, and the
router's encode hop in front, on the generated demo-whisper and demo-bart models."""

from __future__ import annotations

import re
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import yaml
from kvferry_testing.procs import Proc, free_port

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "whisper-service.yaml"
# Small KV caches and contexts: each pod stays well within a shared CI machine's memory.
EXTRA_ARGS = ["--kv-cache-memory-bytes", str(64 * 1024 * 1024)]
MAX_MODEL_LEN = 64


def launch(tmp: Path, manifest: dict, pods: list[str]) -> tuple[Proc, dict[str, str]]:
    """`kvferry up -f` of `manifest` once it says ready; it and pod name -> URL."""
    path = tmp / "service.yaml"
    path.write_text(yaml.safe_dump(manifest))
    port = free_port()
    proc = Proc([sys.executable, "-m", "kvferry.cli", "up", "-f", str(path), "--port",
                 str(port)], tmp / "up.log")
    proc.port = port  # type: ignore[attr-defined]
    deadline = time.monotonic() + 300
    while "ready: http" not in proc.log():
        if proc.proc.poll() is not None or time.monotonic() > deadline:
            proc.stop()
            raise AssertionError(proc.log())
        time.sleep(0.2)
    urls = dict(re.findall(r"pod (\S+): (http://127\.0\.0\.1:\d+)", proc.log()))
    assert sorted(urls) == sorted(pods), proc.log()
    return proc, urls


def stop(proc: Proc) -> None:
    assert proc.stop(timeout_s=60) == 0, proc.log()
    assert "Traceback" not in proc.log(), proc.log()
    assert "not served yet" not in proc.log()


def router_url(proc: Proc) -> str:
    return f"http://127.0.0.1:{proc.port}"  # type: ignore[attr-defined]


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", trust_env=False).text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample.split("{")[0] == name and all(f'{k}="{v}"' in sample for k, v in labels.items()):
            total += float(value)
    return total


def up_error(tmp: Path, model: dict, pools: dict) -> str:
    """The error of a `kvferry up` that must stop before it starts anything."""
    manifest = {"apiVersion": "kvferry.dev/v1alpha1", "kind": "InferenceService",
                "metadata": {"name": "kinds"}, "spec": {"model": model, "pools": pools}}
    path = tmp / "service.yaml"
    path.write_text(yaml.safe_dump(manifest))
    done = subprocess.run([sys.executable, "-m", "kvferry.cli", "up", "-f", str(path),
                           "--port", str(free_port())], capture_output=True, text=True,
                          timeout=60, check=False)
    assert (done.returncode, done.stdout) == (2, ""), done
    return done.stderr


def test_a_checkpoint_of_another_kind_than_the_spec_says_is_refused_before_anything_starts(
        tmp_path: Path) -> None:
    """An encoder pool over a model typed decoder-only would run no encoder: `kvferry up`
    reads the checkpoint's kind and says what to change."""
    from kvferry.engine.models.source import resolve_model_source

    bart, llama = resolve_model_source("demo-bart"), resolve_model_source("demo")
    said = up_error(tmp_path, {"source": f"hostpath://{bart}"}, {"decode": {}})
    assert said == (f"kvferry up: error: spec.model.source hostpath://{bart} is "
                    "BartForConditionalGeneration, an encoder-decoder model, and "
                    "spec.model.type says decoder-only: set spec.model.type: encoder-decoder\n")
    said = up_error(tmp_path, {"source": f"hostpath://{llama}", "type": "encoder-decoder"},
                    {"encoder": {}, "decode": {}})
    assert said == (f"kvferry up: error: spec.model.source hostpath://{llama} is "
                    "LlamaForCausalLM, a decoder-only model, and spec.model.type says "
                    "encoder-decoder: set spec.model.type: decoder-only and drop "
                    "spec.pools.encoder\n")
    # demo-whisper typed decoder-only: the manifest's own rule refuses it.
    said = up_error(tmp_path, {"source": "demo-whisper"}, {"encoder": {}, "decode": {}})
    assert "demo-bart and demo-whisper are encoder-decoder models: set spec.model.type: " \
        "encoder-decoder" in said and "spec.pools.encoder runs the encoder of an " \
        "encoder-decoder model" in said, said


# ---------------------------------------------------------------------------- Whisper
@pytest.fixture(scope="module")
def whisper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, dict[str, str]]]:
    """The example service with two decode pods and a prefill pod for long decoder prompts
    (16 tokens and more), small KV caches and a short context."""
    manifest = yaml.safe_load(EXAMPLE.read_text())
    spec = manifest["spec"]
    spec["model"]["maxModelLen"] = MAX_MODEL_LEN
    spec["engine"]["extraArgs"] = EXTRA_ARGS
    spec["pools"]["decode"]["replicas"] = 2
    spec["pools"]["prefill"] = {"replicas": 1}
    spec["router"]["prefillThresholdTokens"] = 16
    proc, urls = launch(tmp_path_factory.mktemp("up-whisper"), manifest,
                        ["whisper-demo-encoder-0", PREFILL_POD, *DECODE_PODS])
    try:
        yield proc, urls
    finally:
        stop(proc)


DECODE_PODS = ["whisper-demo-decode-0", "whisper-demo-decode-1"]
PREFILL_POD = "whisper-demo-prefill-0"


def decode_total(urls: dict[str, str], name: str) -> float:
    """A metric summed over the Whisper service's decode pods."""
    return sum(metric(urls[pod], name) for pod in DECODE_PODS)


def wav(samples: np.ndarray, rate: int, note: bytes = b"") -> bytes:
    """16-bit mono WAV bytes; `note` goes in a LIST chunk before the data, which changes the
    file (and so its key) but not the audio decoded from it."""
    pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt
    if note:
        info = b"INFO" + b"ICMT" + struct.pack("<I", len(note)) + note
        chunks += b"LIST" + struct.pack("<I", len(info)) + info
    chunks += b"data" + struct.pack("<I", len(pcm)) + pcm
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


def tone(seconds: float, hz: float, rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def transcribe(url: str, data: bytes, **fields: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    return client.audio.transcriptions.create(model="whisper", file=("a.wav", data),
                                              language="en", **fields).text


def test_a_transcription_is_encoded_on_the_encoder_pod_and_pulled_by_the_decode_pod(
        whisper: tuple[Proc, dict[str, str]]) -> None:
    proc, urls = whisper
    router, encoder = router_url(proc), urls["whisper-demo-encoder-0"]
    samples = tone(2.0, 440)
    through_pools = transcribe(router, wav(samples, 16000))
    assert metric(router, "kvferry:router_encode_hops_total",
                  endpoint="/v1/audio/transcriptions") == 1
    # The encoder ran on the encoder pod (one 30 s window: 1500 positions), and a decode
    # pod pulled its blocks instead.
    assert metric(encoder, "kvferry:encoder_tokens_total") == 1500
    assert decode_total(urls, "kvferry:encoder_tokens_total") == 0
    pulled = [metric(urls[pod], "kvferry:cross_attention_bytes_pulled_total")
              for pod in DECODE_PODS]
    assert min(pulled) == 0 and max(pulled) > 0  # one pod pulled, once
    # The same audio in another file (other bytes, so another key) sent to a decode pod
    # itself, which runs the encoder: the same transcript.
    decode = urls[DECODE_PODS[0]]
    locally = transcribe(decode, wav(samples, 16000, note=b"another file"))
    assert metric(decode, "kvferry:encoder_tokens_total") == 1500
    assert through_pools == locally and through_pools


def test_a_file_the_decode_pod_holds_skips_the_encode_hop(
        whisper: tuple[Proc, dict[str, str]]) -> None:
    proc, urls = whisper
    router = router_url(proc)
    pods = [urls["whisper-demo-encoder-0"], *(urls[pod] for pod in DECODE_PODS)]
    data = wav(tone(1.0, 880), 16000)
    first = transcribe(router, data)
    # Until the decode pod's KV event with the file's cross blocks reaches the router's
    # index, the file may be encoded again; then it is not, on either pod.
    deadline = time.monotonic() + 10
    while True:
        skips = metric(router, "kvferry:router_encode_skips_total", reason="cached_on_decode")
        encoded = [metric(pod, "kvferry:encoder_tokens_total") for pod in pods]
        assert transcribe(router, data) == first
        if metric(router, "kvferry:router_encode_skips_total",
                  reason="cached_on_decode") == skips + 1:
            break
        assert time.monotonic() < deadline, "the router never skipped the encode hop"
        time.sleep(0.2)
    # The router sent the file to the decode pod holding its cross blocks, which took them
    # from its cache: no encoder ran anywhere (the other decode pod would have run one).
    assert [metric(pod, "kvferry:encoder_tokens_total") for pod in pods] == encoded


def test_a_streamed_transcription_comes_through_the_pools_event_by_event(
        whisper: tuple[Proc, dict[str, str]]) -> None:
    """The encode hop answers whole whatever the client asked; the decode pod's events come
    through the router as it sends them."""
    proc, _ = whisper
    router = router_url(proc)
    data = wav(tone(1.5, 330), 16000)
    hops = metric(router, "kvferry:router_encode_hops_total")
    client = openai.OpenAI(base_url=router + "/v1", api_key="none", max_retries=0, timeout=120)
    events = list(client.audio.transcriptions.create(model="whisper", file=("a.wav", data),
                                                     language="en", stream=True))
    assert metric(router, "kvferry:router_encode_hops_total") == hops + 1
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    (done,) = [e for e in events if e.type == "transcript.text.done"]
    assert len(deltas) > 1 and "".join(deltas) == done.text
    assert done.text == transcribe(router, data)


def test_a_long_previous_text_goes_encoder_then_prefill_then_decode(
        whisper: tuple[Proc, dict[str, str]]) -> None:
    """The prefill pod pulls the encoder pod's cross blocks and computes the decoder prompt;
    the decode pod pulls both; the transcript is the one a decode pod gives by itself."""
    proc, urls = whisper
    router, prefill = router_url(proc), urls[PREFILL_POD]
    prompt = "these are the words the speaker said before this part of the recording began"
    samples = tone(1.2, 550)
    before = decode_total(urls, "kvferry:kv_transfer_bytes_total")
    cross_before = decode_total(urls, "kvferry:cross_attention_bytes_pulled_total")
    through_pools = transcribe(router, wav(samples, 16000), prompt=prompt)
    assert metric(prefill, "kvferry:cross_attention_bytes_pulled_total") > 0
    assert metric(prefill, "kvferry:encoder_tokens_total") == 0
    pulled = decode_total(urls, "kvferry:kv_transfer_bytes_total") - before
    cross = decode_total(urls, "kvferry:cross_attention_bytes_pulled_total") - cross_before
    assert pulled > cross > 0  # the decoder prompt's blocks came with the cross blocks
    assert metric(router, "kvferry:router_pod_chosen_total", pool="prefill") == 1
    # A short previous text skips the prefill pool.
    transcribe(router, wav(tone(0.8, 300), 16000), prompt="a few words")
    assert metric(router, "kvferry:router_prefill_skips_total", reason="short_prompt") >= 1
    assert metric(router, "kvferry:router_pod_chosen_total", pool="prefill") == 1
    locally = transcribe(urls[DECODE_PODS[1]], wav(samples, 16000, note=b"on its own"),
                         prompt=prompt)
    assert through_pools == locally and through_pools


# ---------------------------------------------------------------------------- BART
@pytest.fixture(scope="module")
def bart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, dict[str, str]]]:
    manifest = {
        "apiVersion": "kvferry.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "summaries"},
        "spec": {
            "model": {"source": "demo-bart", "type": "encoder-decoder", "dtype": "float32",
                      "maxModelLen": MAX_MODEL_LEN},
            "engine": {"blockSize": 16, "extraArgs": EXTRA_ARGS},
            "pools": {"encoder": {"replicas": 1}, "decode": {"replicas": 1}},
        },
    }
    proc, urls = launch(tmp_path_factory.mktemp("up-bart"), manifest,
                        ["summaries-encoder-0", "summaries-decode-0"])
    try:
        yield proc, urls
    finally:
        stop(proc)


def test_a_text_completion_takes_the_encode_hop_and_answers_as_the_model_does(
        bart: tuple[Proc, dict[str, str]]) -> None:
    from kvferry import LLM, SamplingParams

    proc, urls = bart
    router = router_url(proc)
    prompt = "Tura bako lime sen, and the river ran."
    client = openai.OpenAI(base_url=router + "/v1", api_key="none", max_retries=0, timeout=60)
    answer = client.completions.create(model="summaries", prompt=prompt, max_tokens=8,
                                       temperature=0.0,
                                       extra_body={"ignore_eos": True})
    assert metric(router, "kvferry:router_encode_hops_total", endpoint="/v1/completions") == 1
    assert metric(urls["summaries-decode-0"], "kvferry:cross_attention_bytes_pulled_total") > 0
    # The router tokenized the text itself (kvferry up gives it the demo's tokenizer).
    assert metric(router, "kvferry:router_tokenized_prompts_total", where="router") == 1
    llm = LLM(model="demo-bart", max_model_len=MAX_MODEL_LEN, block_size=16, dtype="float32",
              device="cpu", seed=0)
    [expected] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8,
                                                       ignore_eos=True), use_tqdm=False)
    assert answer.choices[0].text == expected.outputs[0].text
    # Streamed, the same prompt comes back to the decode pod that holds its cross blocks.
    deadline = time.monotonic() + 10
    while metric(router, "kvferry:router_encode_skips_total", reason="cached_on_decode") < 1:
        stream = client.completions.create(model="summaries", prompt=prompt, max_tokens=8,
                                           temperature=0.0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream) == expected.outputs[0].text
        assert time.monotonic() < deadline, "the router never skipped the encode hop"
