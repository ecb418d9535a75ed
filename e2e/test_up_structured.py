"""Structured outputs and tool calls through `kvferry up` of a prefill and a decode pod (the
demo model: random weights, byte-level tokens): a prompt long enough for both hops is
answered under its constraint, whole and streamed. The prefill pod samples the first token
under the grammar; the decode pod, which samples it again from the pulled KV, runs the
grammar from the start of the output."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import yaml
from kvferry.router.config import RouterSettings
from kvferry_testing.procs import Proc, free_port

SERVICE = "structured"
# Well past the router's prefill threshold in the demo tokenizer's tokens.
LONG_TEXT = " ".join(["the history of the river and the town"] * 24)


def long_prompt(tag: str) -> str:
    """A long prompt no pod has seen: a decode pod holding a prompt skips its prefill hop."""
    return f"{tag}: {LONG_TEXT}"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10},
                   "size": {"enum": ["small", "large"]},
                   "tags": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                       "maximum": 99}, "maxItems": 3},
                   "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                             "required": ["ok"], "additionalProperties": False}},
    "required": ["name", "size", "tags", "inner"], "additionalProperties": False,
}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 16},
                                     "limit": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["query", "limit"], "additionalProperties": False}}}


def service_yaml(tmp: Path) -> Path:
    manifest = {
        "apiVersion": "kvferry.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": SERVICE},
        "spec": {
            "model": {"source": "demo", "dtype": "float32", "maxModelLen": 1024},
            "engine": {"blockSize": 16, "maxNumSeqs": 8,
                       "extraArgs": ["--kv-cache-memory-bytes", str(32 << 20)]},
            "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
        },
    }
    path = tmp / "service.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("up-structured")
    port = free_port()
    proc = Proc([sys.executable, "-m", "kvferry.cli", "up", "-f", str(service_yaml(tmp)),
                 "--port", str(port)], tmp / "up.log")
    proc.port = port  # type: ignore[attr-defined]
    deadline = time.monotonic() + 240
    while "ready: http" not in proc.log():
        if proc.proc.poll() is not None or time.monotonic() > deadline:
            proc.stop()
            raise AssertionError(proc.log())
        time.sleep(0.2)
    try:
        yield proc
    finally:
        assert proc.stop(timeout_s=60) == 0, proc.log()
        assert "Traceback" not in proc.log(), proc.log()


def router_metric(proc: Proc, name: str, **labels: str) -> float:
    total = 0.0
    text = httpx.get(f"http://127.0.0.1:{proc.port}/metrics", trust_env=False).text  # type: ignore[attr-defined]
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample.split("{")[0] == name and all(f'{k}="{v}"' in sample for k, v in labels.items()):
            total += float(value)
    return total


def chat(c: openai.OpenAI, stream: bool, tag: str, **kwargs: Any
         ) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of a one-choice chat answer, whole or streamed."""
    messages = [{"role": "user", "content": long_prompt(tag)}]
    if not stream:
        out = c.chat.completions.create(model=SERVICE, messages=messages, **kwargs)
        message = out.choices[0].message
        return message.content, [(t.function.name, t.function.arguments)
                                 for t in message.tool_calls or ()]
    content, calls = None, {}
    for chunk in c.chat.completions.create(model=SERVICE, messages=messages, stream=True,
                                           **kwargs):
        for choice in chunk.choices:
            if choice.delta.content:
                content = (content or "") + choice.delta.content
            for piece in choice.delta.tool_calls or ():
                name, arguments = calls.get(piece.index, ("", ""))
                calls[piece.index] = (piece.function.name or name,
                                      arguments + (piece.function.arguments or ""))
    return content, [calls[i] for i in sorted(calls)]


def complete(c: openai.OpenAI, stream: bool, tag: str, extra: dict[str, Any]) -> str:
    kwargs: dict[str, Any] = {"model": SERVICE, "prompt": long_prompt(tag), "max_tokens": 120,
                              "extra_body": extra}
    if not stream:
        return c.completions.create(**kwargs).choices[0].text
    return "".join(chunk.choices[0].text for chunk in c.completions.create(stream=True, **kwargs)
                   if chunk.choices)


def test_constrained_answers_take_both_hops_and_hold_their_constraint(up: Proc) -> None:
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{up.port}/v1", api_key="none",  # type: ignore[attr-defined]
                      max_retries=0, timeout=120)
    num_tokens = c.completions.create(model=SERVICE, prompt=long_prompt("count"),
                                      max_tokens=1).usage
    assert num_tokens.prompt_tokens > RouterSettings.prefill_threshold_tokens  # type: ignore[union-attr]
    hops = router_metric(up, "kvferry:router_hop_requests_total", hop="prefill", outcome="200")
    regex = r"[0-9]{2}-[a-z]{3,6}"
    answered = 0
    for stream in (False, True):
        content, calls = chat(c, stream, f"schema {stream}", max_tokens=200, response_format={
            "type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}})
        jsonschema.validate(json.loads(content or ""), SCHEMA)
        assert calls == []
        content, calls = chat(c, stream, f"tool {stream}", max_tokens=200, tools=[TOOL],
                              tool_choice={"type": "function", "function": {"name": "lookup"}})
        [(name, arguments)] = calls
        assert name == "lookup" and not content
        jsonschema.validate(json.loads(arguments), TOOL["function"]["parameters"])
        assert re.fullmatch(regex, complete(c, stream, f"regex {stream}",
                                            {"guided_regex": regex}))
        assert complete(c, stream, f"choice {stream}",
                        {"guided_choice": ["left", "right"]}) in ("left", "right")
        answered += 4
    # Every one of them went through the prefill pod first, and none fell back.
    grown = router_metric(up, "kvferry:router_hop_requests_total", hop="prefill",
                          outcome="200") - hops
    assert grown == answered
    assert router_metric(up, "kvferry:router_prefill_fallbacks_total") == 0
