"""Every field of OpenAI's and vLLM's request schemas, for both generation endpoints, is
honoured or refused with a 400 that names it; the router and the pods answer alike; a
refused field sent with a value that asks for nothing is accepted; fields neither schema
has are ignored, logged once and counted.

The field lists below are the schemas as their owners publish them (OpenAI's API
reference and vLLM's protocol), written out here so that a field the server does not
know cannot go unnoticed: the test fails on any field that is neither a model field of
the server, nor accepted as changing nothing, nor refused."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from kvferry_testing.request_answers import (
    CHAT,
    COMPLETIONS,
    MODELS,
    engine_answer,
    router_answer,
)
from kvferry_testing.serve_helpers import API_KEY, ServerProcess

from kvferry.protocol.request_checks import known_fields
from kvferry.protocol.request_fields import IGNORED, REFUSED

VALID: dict[str, dict[str, Any]] = {
    COMPLETIONS: {"model": "tiny", "prompt": "w5 w6", "max_tokens": 2},
    CHAT: {"model": "tiny", "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2},
}

OPENAI_COMPLETIONS = [
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options",
    "suffix", "temperature", "top_p", "user",
]
OPENAI_CHAT = [
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions",
    "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities",
    "n", "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key",
    "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier",
    "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
    "top_logprobs", "top_p", "user", "verbosity", "web_search_options",
]
VLLM_COMMON = [
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "allowed_token_ids", "prompt_logprobs", "bad_words", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "structural_tag",
    "guided_decoding_backend", "guided_whitespace_pattern", "priority", "request_id",
    "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs", "add_special_tokens",
]
VLLM_COMPLETIONS = [*VLLM_COMMON, "prompt_embeds", "response_format"]
VLLM_CHAT = [*VLLM_COMMON, "best_of", "echo", "add_generation_prompt",
             "continue_final_message", "documents", "chat_template", "chat_template_kwargs",
             "mm_processor_kwargs"]
SCHEMAS = {COMPLETIONS: sorted({*OPENAI_COMPLETIONS, *VLLM_COMPLETIONS}),
           CHAT: sorted({*OPENAI_CHAT, *VLLM_CHAT})}

# A value of each field that asks for something (not its default), of the field's type.
ASKING: dict[str, Any] = {
    "best_of": 3, "suffix": "the end", "use_beam_search": True, "length_penalty": 0.5,
    "spaces_between_special_tokens": False, "truncate_prompt_tokens": 4,
    "prompt_logprobs": 1, "bad_words": ["w5"], "structured_outputs": {"json": {}},
    "guided_json": {"type": "object"}, "guided_regex": "w[0-9]+", "guided_choice": ["w5"],
    "guided_grammar": "root ::= \"w5\"", "structural_tag": "{}",
    "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ",
    "request_id": "abc", "logits_processors": ["my.module:Processor"],
    "return_tokens_as_token_ids": True, "return_token_ids": True, "cache_salt": "salt",
    "vllm_xargs": {"a": 1}, "prompt_embeds": "AAAA", "response_format": {"type": "json_object"},
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "w5"}, "reasoning_effort": "high",
    "verbosity": "low", "web_search_options": {}, "functions": [{"name": "f"}],
    "function_call": "auto", "continue_final_message": True, "echo": True,
    "add_special_tokens": True, "documents": [{"text": "w5"}], "chat_template": "{{ x }}",
    "mm_processor_kwargs": {"a": 1},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "tool_choice": "required", "parallel_tool_calls": False,
    "metadata": {"k": "v"}, "store": True, "service_tier": "auto", "prompt_cache_key": "k",
    "safety_identifier": "u", "user": "u",
}
# Fields that ask for something only beside another: that other field, after them.
BESIDE: dict[str, dict[str, Any]] = {"parallel_tool_calls": {"tools": ASKING["tools"]}}
# Values that ask for nothing: a refused field sent with one of them is accepted.
INERT: dict[str, Any] = {
    "best_of": 1, "suffix": "", "use_beam_search": False, "length_penalty": 1.0,
    "spaces_between_special_tokens": True, "bad_words": [], "logits_processors": [],
    "return_tokens_as_token_ids": False, "return_token_ids": False, "vllm_xargs": {},
    "modalities": ["text"], "functions": [],
    "continue_final_message": False, "echo": False, "add_special_tokens": False,
    "documents": [],
}


CASES = [(endpoint, name) for endpoint, names in SCHEMAS.items() for name in names]


@pytest.mark.parametrize(("endpoint", "name"), CASES,
                         ids=[f"{'chat' if e == CHAT else 'completions'}-{n}" for e, n in CASES])
def test_each_schema_field_is_honoured_or_refused_by_name(endpoint: str, name: str) -> None:
    model_fields = set(MODELS[endpoint].model_fields)
    refused = REFUSED[endpoint]
    assert (name in model_fields) + (name in IGNORED) + (name in refused) == 1, (
        f"{name} must be exactly one of: honoured, accepted as changing nothing, refused")
    assert (name in known_fields(endpoint)) == (name in model_fields), (
        "the router's table and the engine's model must honour the same fields")
    if name in model_fields:
        return  # honoured: what each does is tested where it is built
    body = {**VALID[endpoint], name: ASKING[name], **BESIDE.get(name, {})}
    expected = name if name in refused else None
    assert engine_answer(endpoint, body, sampling=True) == expected
    assert router_answer(endpoint, body) == expected
    if name in refused:
        assert refused[name].why  # the message says why, not only that


@pytest.mark.parametrize(("endpoint", "name"),
                         [(e, n) for e, names in REFUSED.items() for n in names])
def test_a_refused_field_that_asks_for_nothing_is_accepted(endpoint: str, name: str) -> None:
    for value in [None, *([INERT[name]] if name in INERT else [])]:
        body = {**VALID[endpoint], name: value}
        assert engine_answer(endpoint, body, sampling=True) is None, (name, value)
        assert router_answer(endpoint, body) is None, (name, value)


def test_every_refused_field_is_in_a_schema() -> None:
    """The table refuses only fields the two schemas have (a typo would refuse nothing)."""
    for endpoint, refused in REFUSED.items():
        assert set(refused) <= set(SCHEMAS[endpoint]), set(refused) - set(SCHEMAS[endpoint])


def metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def post(server: ServerProcess, endpoint: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + endpoint, json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"})


@pytest.mark.parametrize(("endpoint", "name"), [(COMPLETIONS, "suffix"),
                                                (COMPLETIONS, "best_of"),
                                                (CHAT, "use_beam_search"),
                                                (CHAT, "reasoning_effort")])
def test_a_live_server_refuses_with_the_field_named(live_server: ServerProcess, endpoint: str,
                                                     name: str) -> None:
    response = post(live_server, endpoint, {**VALID[endpoint], name: ASKING[name]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == name and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{name}: ")


def test_unknown_fields_are_ignored_logged_once_and_counted(live_server: ServerProcess) -> None:
    before = metric(live_server, "kvferry:unknown_request_fields_total")
    for _ in range(3):
        response = post(live_server, COMPLETIONS,
                        {**VALID[COMPLETIONS], "future_field": 1, "store": True})
        assert response.status_code == 200, response.text
    # `store` is a known field that changes nothing: not counted.
    assert metric(live_server, "kvferry:unknown_request_fields_total") == before + 3
    log = live_server.log()
    assert log.count("'future_field' is not one this server knows") == 1
