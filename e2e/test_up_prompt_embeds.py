"""Prompt embeddings through `kvferry up` with a prefill and a decode pod, for every
decoder-only family: a long prompt given as `embed_tokens(ids)` takes both hops (the decode
pod pulls its KV) and answers what the ids answer, and the engines publish the very block
hashes the router computes from the payload (placeholder ids with the embeddings' hash)."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
import yaml
from kvferry_testing.checkpoints import make_checkpoint  # noqa: F401 (fixture)
from kvferry_testing.embeds import embedding_table, encode
from kvferry_testing.procs import Proc, free_port

from kvferry.protocol.block_hash import hash_request_blocks
from kvferry.protocol.kv_events import split_hashes
from kvferry.protocol.prompt_embeds import PLACEHOLDER_TOKEN_ID, embeds_salt

SERVICE_NAME = "embedsup"
ARCHITECTURES = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
BLOCK_SIZE = 16
PODS = [f"{SERVICE_NAME}-prefill-0", f"{SERVICE_NAME}-decode-0"]
# Longer than the router's prefill threshold (256 tokens): the prefill hop runs.
PROMPT_LEN = 300


def service_yaml(tmp: Path, checkpoint: Path) -> Path:
    manifest = {
        "apiVersion": "kvferry.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": SERVICE_NAME},
        "spec": {
            "model": {"source": f"hostpath://{checkpoint}", "dtype": "float32",
                      "maxModelLen": 1024},
            "engine": {"blockSize": BLOCK_SIZE, "maxNumSeqs": 4, "enablePromptEmbeds": True,
                       "extraArgs": ["--kv-cache-memory-bytes", str(16 * 1024 * 1024)]},
            "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
        },
    }
    path = tmp / "service.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


@pytest.fixture(scope="module", params=ARCHITECTURES)
def up(request, tmp_path_factory: pytest.TempPathFactory, make_checkpoint
       ) -> Iterator[tuple[Proc, dict[str, str], torch.Tensor]]:
    """`kvferry up` of a prefill and a decode pod of the family's checkpoint."""
    checkpoint = make_checkpoint(request.param)
    tmp = tmp_path_factory.mktemp("embedsup")
    port = free_port()
    proc = Proc([sys.executable, "-m", "kvferry.cli", "up", "-f",
                 str(service_yaml(tmp, checkpoint)), "--port", str(port)], tmp / "up.log")
    proc.port = port  # type: ignore[attr-defined]
    try:
        deadline = time.monotonic() + 240
        while "ready: http" not in proc.log():
            assert proc.proc.poll() is None and time.monotonic() < deadline, proc.log()
            time.sleep(0.2)
        pods = dict(re.findall(r"pod (\S+): (http://127\.0\.0\.1:\d+)", proc.log()))
        assert sorted(pods) == sorted(PODS), proc.log()
        yield proc, pods, embedding_table(checkpoint)
    finally:
        assert proc.stop(timeout_s=60) == 0, proc.log()
    assert "Traceback" not in proc.log(), proc.log()


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith((name + "{", name + " ")):
            sample, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in sample for k, v in labels.items()):
                total += float(value)
    return total


def published_hashes(proc: Proc, pod: str) -> set[bytes]:
    """The block hashes `pod` has published as stored (its KV events in Redis)."""
    import redis

    redis_url = re.search(r"registered as \S+ \(\S+\) in (redis://\S+)", proc.log()).group(1)
    entries = redis.Redis.from_url(redis_url).xrange(f"kvferry:{SERVICE_NAME}:kv_events")
    stored: set[bytes] = set()
    for _, fields in entries:
        if fields[b"pod"].decode() == pod:
            stored.update(split_hashes(fields[b"stored"]))
    return stored


def test_a_long_embedding_prompt_takes_both_hops_and_answers_like_its_ids(up) -> None:
    proc, pods, table = up
    router = f"http://127.0.0.1:{proc.port}"  # type: ignore[attr-defined]
    decode = pods[f"{SERVICE_NAME}-decode-0"]
    client = openai.OpenAI(base_url=router + "/v1", api_key="none", max_retries=0, timeout=120)
    ids = torch.randint(3, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7))
    greedy = {"model": SERVICE_NAME, "max_tokens": 12, "temperature": 0}
    extra = {"ignore_eos": True, "skip_special_tokens": False}
    by_ids = client.completions.create(prompt=ids.tolist(), **greedy, extra_body=extra)

    hops = metric(router, "kvferry:router_hop_requests_total", hop="prefill")
    pulled = metric(decode, "kvferry:kv_transfer_bytes_total")
    embeds = table[ids]
    by_embeds = client.completions.create(prompt="", **greedy,
                                          extra_body={**extra, "prompt_embeds": encode(embeds)})
    assert by_embeds.choices[0].text == by_ids.choices[0].text.removeprefix(" ")
    assert by_embeds.usage is not None and by_embeds.usage.prompt_tokens == PROMPT_LEN
    # Both hops ran: the prefill pod computed the prompt, the decode pod pulled its KV.
    assert metric(router, "kvferry:router_hop_requests_total", hop="prefill") > hops
    assert metric(decode, "kvferry:kv_transfer_bytes_total") > pulled

    # The engines key its blocks exactly as the router does from the payload.
    expected = hash_request_blocks([PLACEHOLDER_TOKEN_ID] * PROMPT_LEN, BLOCK_SIZE, [],
                                   embeds_salt(embeds))
    deadline = time.monotonic() + 10
    while not set(expected) <= published_hashes(proc, f"{SERVICE_NAME}-decode-0"):
        assert time.monotonic() < deadline, "the decode pod never published the blocks"
        time.sleep(0.1)
    # So the same prompt again is a prefix hit on the decode pod: no prefill hop.
    skips = metric(router, "kvferry:router_prefill_skips_total", reason="cached_on_decode")
    again = client.completions.create(prompt="", **greedy,
                                       extra_body={**extra, "prompt_embeds": encode(embeds)})
    assert again.choices[0].text == by_embeds.choices[0].text
    assert metric(router, "kvferry:router_prefill_skips_total",
                  reason="cached_on_decode") == skips + 1
