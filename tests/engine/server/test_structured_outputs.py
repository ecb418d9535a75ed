"""Structured outputs and tool calls through a live `kvferry serve` of a random-weight model
(the demo checkpoint: byte-level tokens, free text never JSON), with the official `openai`
client, streamed and not, n = 2: every answer parses and validates; a constraint that
cannot be served is a 400 naming the field, before any stream starts."""

from __future__ import annotations

import concurrent.futures
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from kvferry_testing.serve_helpers import ServerProcess

MODEL = "demo"
# Nested objects, arrays, enums and required fields, each string and array bounded so that a
# random model closes every object within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "colour", "tags", "address", "active"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12},
                   "unit": {"enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"], "additionalProperties": False}}}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def server(server_factory: Callable[..., ServerProcess], demo_checkpoint: Path) -> ServerProcess:
    return server_factory(demo_checkpoint, "--served-model-name", MODEL, "--max-model-len",
                          "1024", "--kv-cache-memory-bytes", str(64 << 20), "--dtype",
                          "float32", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=120)


def chat(client: openai.OpenAI, stream: bool, **kwargs: Any) -> list[dict[str, Any]]:
    """The choices of one chat request as {content, tool_calls, finish_reason}, whole or
    assembled from the stream's chunks."""
    if not stream:
        out = client.chat.completions.create(model=MODEL, **kwargs)
        return [{"content": c.message.content, "finish_reason": c.finish_reason,
                 "tool_calls": [(t.id, t.function.name, t.function.arguments)
                                for t in c.message.tool_calls or ()]}
                for c in sorted(out.choices, key=lambda c: c.index)]
    choices: dict[int, dict[str, Any]] = {}
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        for c in chunk.choices:
            state = choices.setdefault(c.index, {"content": None, "calls": {},
                                                 "finish_reason": None})
            if c.delta.content:
                state["content"] = (state["content"] or "") + c.delta.content
            for piece in c.delta.tool_calls or ():
                call = state["calls"].setdefault(piece.index, ["", "", ""])
                call[0] = piece.id or call[0]
                call[1] = (piece.function.name if piece.function and piece.function.name
                           else call[1])
                call[2] += piece.function.arguments if piece.function else ""
            state["finish_reason"] = c.finish_reason or state["finish_reason"]
    return [{"content": s["content"], "finish_reason": s["finish_reason"],
             "tool_calls": [tuple(s["calls"][i]) for i in sorted(s["calls"])]}
            for _, s in sorted(choices.items())]


def test_fifty_json_schema_requests_all_parse_and_validate(client: openai.OpenAI) -> None:
    def ask(i: int) -> list[dict[str, Any]]:
        return chat(client, stream=i % 2 == 1, n=2, max_tokens=300, response_format=RESPONSE_FORMAT,
                    messages=[{"role": "user", "content": f"Person number {i}, please."}])

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = [c for choices in pool.map(ask, range(50)) for c in choices]
    assert len(answers) == 100
    for answer in answers:
        assert answer["finish_reason"] == "stop" and not answer["tool_calls"], answer
        jsonschema.validate(json.loads(answer["content"]), SCHEMA)
    assert len({a["content"] for a in answers}) > 90


def test_free_text_of_the_same_model_is_never_json(client: openai.OpenAI) -> None:
    answers = chat(client, stream=False, n=2, max_tokens=40,
                   messages=[{"role": "user", "content": "Person number 1, please."}])

    def parses(text: str) -> bool:
        try:
            json.loads(text)
        except ValueError:
            return False
        return True

    assert not any(parses(a["content"]) for a in answers)


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_fields_on_completions_always_match(client: openai.OpenAI, stream: bool) -> None:
    regex = r"[0-9]{3}-[a-z]{2,5}"
    choices = ["yes", "no", "it depends"]
    cases = [({"guided_regex": regex}, lambda t: re.fullmatch(regex, t)),
             ({"structured_outputs": {"regex": regex}}, lambda t: re.fullmatch(regex, t)),
             ({"guided_choice": choices}, lambda t: t in choices),
             ({"structured_outputs": {"choice": choices}}, lambda t: t in choices),
             ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)
              or True),
             ({"guided_grammar": 'root ::= "(" ("ab" | "c")* ")"'},
              lambda t: re.fullmatch(r"\((ab|c)*\)", t))]
    for extra, matches in cases:
        for prompt in ("Answer:", "The code is"):
            texts = _completion_texts(client, stream, prompt, extra)
            assert len(texts) == 2 and all(matches(t) for t in texts), (extra, texts)


def _completion_texts(client: openai.OpenAI, stream: bool, prompt: str,
                      extra: dict[str, Any]) -> list[str]:
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": prompt, "n": 2, "max_tokens": 300,
                              "extra_body": extra}
    if not stream:
        out = client.completions.create(**kwargs)
        assert all(c.finish_reason == "stop" for c in out.choices)
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    texts = ["", ""]
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.text
    return texts


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_returns_calls_whose_arguments_validate(
        client: openai.OpenAI, stream: bool) -> None:
    answers = chat(client, stream=stream, n=2, max_tokens=200, tools=[WEATHER, TIME],
                   tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert len(answers) == 2
    for answer in answers:
        assert answer["finish_reason"] == "stop" and not answer["content"], answer
        [(call_id, name, arguments)] = answer["tool_calls"]
        assert call_id.startswith("call_") and name == "get_weather"
        jsonschema.validate(json.loads(arguments), PARAMETERS["get_weather"])


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_returns_calls_of_the_given_tools(
        client: openai.OpenAI, stream: bool) -> None:
    for parallel in (True, False):
        answers = chat(client, stream=stream, n=2, max_tokens=300, tools=[WEATHER, TIME],
                       tool_choice="required", parallel_tool_calls=parallel, seed=7,
                       messages=[{"role": "user", "content": "Weather and time?"}])
        for answer in answers:
            assert answer["tool_calls"] and (parallel or len(answer["tool_calls"]) == 1)
            for _, name, arguments in answer["tool_calls"]:
                jsonschema.validate(json.loads(arguments), PARAMETERS[name])
            # One call closes the array; any number of them may not (a random model can
            # add calls until max_tokens: the complete ones still come back).
            assert answer["finish_reason"] == "tool_calls" or (
                parallel and answer["finish_reason"] == "length"), answer


def test_auto_tool_choice_with_a_parser_answers_the_models_text(client: openai.OpenAI) -> None:
    # The random model writes no <tool_call> block: its text comes back as content.
    for stream in (False, True):
        [answer] = chat(client, stream=stream, max_tokens=8, tools=[WEATHER],
                        messages=[{"role": "user", "content": "Hi"}],
                        extra_body={"ignore_eos": True})
        assert answer["tool_calls"] == [] and answer["content"], answer
        assert answer["finish_reason"] == "length"


def test_auto_tool_choice_parses_a_hermes_call_out_of_the_text(client: openai.OpenAI) -> None:
    # The model is made to write a Hermes block (a choice constraint beside tool_choice
    # auto): the parser turns it into a call, and the text around it into content.
    text = ('Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius", "days": 2}}</tool_call>')
    for stream in (False, True):
        answers = chat(client, stream=stream, n=2, max_tokens=100, tools=[WEATHER, TIME],
                       messages=[{"role": "user", "content": "Weather in Paris?"}],
                       extra_body={"guided_choice": [text]})
        for answer in answers:
            assert answer["content"] == "Checking. " and answer["finish_reason"] == "tool_calls"
            [(call_id, name, arguments)] = answer["tool_calls"]
            assert call_id.startswith("call_") and name == "get_weather"
            assert json.loads(arguments) == {"city": "Paris", "unit": "celsius", "days": 2}


def test_history_with_calls_and_tool_answers_is_served(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    [answer] = chat(client, stream=False, max_tokens=4, tools=[WEATHER], tool_choice="none",
                    messages=messages)
    assert answer["content"] and answer["tool_calls"] == []


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, headers=server.headers)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}}, "response_format",
     "the JSON schema cannot be compiled: Invalid type: objekt"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "format": "no-such-format"}}}},
     "response_format", "the JSON schema cannot be compiled: Unknown format: no-such-format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema",
     "response_format of type 'json_schema' needs json_schema.schema"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type",
     "response_format.type 'structural_tag' is not supported"),
    ({"guided_regex": "a(b"}, "guided_regex", "the regex cannot be compiled: "),
    ({"guided_grammar": "start: foo"}, "guided_grammar", "the grammar cannot be compiled: "),
    ({"guided_choice": []}, "guided_choice", "guided_choice must hold at least one string"),
    ({"guided_regex": "[0-9]", "response_format": {"type": "json_object"}}, "guided_regex",
     "response_format and guided_regex each constrain the output; give one of them"),
    ({"guided_decoding_backend": "xgrammar", "guided_regex": "[0-9]"},
     "guided_decoding_backend", "guided_decoding_backend 'xgrammar' is not available"),
    ({"structured_outputs": {"regex": "[0-9]", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern",
     "structured_outputs.whitespace_pattern: Extra inputs are not permitted"),
    ({"structured_outputs": {"regex": "[0-9]", "choice": ["1"]}}, "structured_outputs",
     ("structured_outputs must set exactly one of json, json_object, regex, choice and "
      "grammar, got regex, choice")),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {
        "type": "json_object"}}, "response_format",
     "tool_choice 'required' and response_format each constrain the output"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", "tool_choice names the function 'x', which is not among the tools"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_constraints_that_cannot_be_served_are_400s_naming_the_field(
        server: ServerProcess, body: dict[str, Any], param: str, message: str,
        stream: bool) -> None:
    answer = post(server, "/v1/chat/completions", {**CHAT, **body, "stream": stream})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["message"].startswith(message), error


def test_tokenize_renders_the_tools_the_template_shows(server: ServerProcess) -> None:
    # The demo template does not show tools: the count is the same with and without.
    plain = post(server, "/tokenize", {"messages": CHAT["messages"]}).json()
    with_tools = post(server, "/tokenize", {"messages": CHAT["messages"], "tools": [WEATHER]})
    assert with_tools.status_code == 200 and with_tools.json()["count"] == plain["count"]


def test_auto_tool_choice_without_a_parser_is_a_400_that_says_so(
        live_server: ServerProcess) -> None:
    answer = post(live_server, "/v1/chat/completions",
                  {**CHAT, "model": "tiny", "tools": [WEATHER]})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "tool_choice"
    assert "needs a parser of the model's tool-call format" in error["message"]
    assert "--tool-call-parser" in error["message"]


def test_a_model_whose_tokenizer_cannot_write_json_refuses_constraints(
        live_server: ServerProcess) -> None:
    answer = post(live_server, "/v1/completions", {"model": "tiny", "prompt": "w5",
                                                   "response_format": {"type": "json_object"}})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "response_format"
    assert error["message"].startswith("structured outputs are not available for this model")
