"""Tool calls read out of model output as it streams: a forced call's arguments, the
constrained array of `required`, and Hermes-style `<tool_call>` blocks of `auto`; what a
request's tools and tool_choice mean, and the chat template's view of calls."""

from __future__ import annotations

import json

import pytest
from kvferry.engine.server.chat_template import render_chat
from kvferry.engine.server.errors import ApiError
from kvferry.engine.server.protocol import ChatCompletionRequest, conversation_of
from kvferry.engine.server.tool_calls import (
    CallExtractor,
    Extracted,
    HermesCalls,
    NamedCall,
    RequiredCalls,
    finish_reason_of,
    tool_plan,
    whole_calls,
)


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def run(extractor: CallExtractor, text: str, size: int) -> tuple[list[Extracted], Extracted]:
    """Feeds `text` in pieces of `size` characters; returns each step's yield and the total."""
    steps = [extractor.feed(piece) for piece in pieces(text, size)] + [extractor.finish()]
    total = Extracted()
    for step in steps:
        total += step
    return steps, total


HERMES = ('Let me check. <tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>\n<tool_call>{"name": "time", "arguments": {"zone": "CET"}}</tool_call>'
          ' Done.')


@pytest.mark.parametrize("size", [1, 3, 7, len(HERMES)])
def test_hermes_calls_come_out_whole_wherever_the_pieces_break(size: int) -> None:
    _, total = run(HermesCalls(parallel=True), HERMES, size)
    assert total.content == "Let me check. \n Done."
    calls = whole_calls(total.calls)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("weather", {"city": "Paris"}), ("time", {"zone": "CET"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_hermes_content_is_streamed_at_once_but_a_possible_tag_is_held() -> None:
    extractor = HermesCalls(parallel=True)
    assert extractor.feed("Hello <tool").content == "Hello "  # "<tool" may open a call
    assert extractor.feed("box> x").content == "<toolbox> x"
    assert extractor.feed("<tool_call>{\"name\": \"f\", ").content == ""
    step = extractor.feed('"arguments": {}}</tool_call>')
    assert step.content == "" and step.calls[0].function.name == "f"  # type: ignore[union-attr]


def test_hermes_keeps_broken_blocks_as_text_and_reads_an_unclosed_last_call() -> None:
    text = '<tool_call>not json</tool_call> <tool_call>{"name": "f", "arguments": {"a": 1}}'
    _, total = run(HermesCalls(parallel=True), text, 5)
    assert total.content == "<tool_call>not json</tool_call> "
    assert [c.function.arguments for c in whole_calls(total.calls)] == ['{"a": 1}']


def test_hermes_without_parallel_calls_keeps_the_first() -> None:
    _, total = run(HermesCalls(parallel=False), HERMES, 4)
    assert [c.function.name for c in whole_calls(total.calls)] == ["weather"]


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_required_calls_go_out_as_each_object_closes(size: int) -> None:
    text = ('[{"name": "weather", "parameters": {"city": "Paris, \\"FR\\"", "days": [1, 2]}}, '
            '{"name": "time", "parameters": {}}]')
    extractor = RequiredCalls(parallel=True)
    steps, total = run(extractor, text, size)
    calls = whole_calls(total.calls)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("weather", {"city": 'Paris, "FR"', "days": [1, 2]}), ("time", {})]
    assert total.content == ""
    # The first call went out before the text of the second was complete.
    first = next(i for i, s in enumerate(steps) if s.calls)
    assert size == 1000 or first < len(steps) - 2
    assert finish_reason_of(plan("required"), extractor, "stop") == "tool_calls"


def test_required_output_cut_short_stays_content() -> None:
    extractor = RequiredCalls(parallel=True)
    _, total = run(extractor, '[{"name": "weather", "parameters": {"ci', 4)
    assert total.calls == [] and total.content == '[{"name": "weather", "parameters": {"ci'
    assert finish_reason_of(plan("required"), extractor, "length") == "length"


def test_a_named_call_streams_its_arguments() -> None:
    extractor = NamedCall("weather")
    steps, total = run(extractor, '{"city": "Paris"}', 6)
    first = steps[0].calls[0]
    assert first.id and first.type == "function" and first.function.name == "weather"  # type: ignore[union-attr]
    assert all(s.calls[0].id is None for s in steps[1:-1])  # later pieces: arguments only
    [call] = whole_calls(total.calls)
    assert call.function.arguments == '{"city": "Paris"}' and call.id == first.id
    # A forced call answers "stop", as OpenAI's do.
    assert finish_reason_of(plan({"type": "function", "function": {"name": "weather"}}),
                            extractor, "stop") == "stop"


TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "time"}}]


def plan(choice: object, parser: str | None = "hermes", **fields: object):
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
        **({} if choice is None else {"tool_choice": choice}), **fields})
    return tool_plan(body, parser)


def test_tool_choice_modes_and_their_constraints() -> None:
    assert plan(None).mode == "auto" and plan(None).constraint() is None
    assert plan("none").mode == "none" and not plan("none").extracts_calls
    named = plan({"type": "function", "function": {"name": "weather"}})
    constraint = named.constraint()
    assert named.mode == "named" and constraint.param == "tool_choice"  # type: ignore[union-attr]
    assert json.loads(constraint.params.json) == TOOLS[0]["function"]["parameters"]  # type: ignore[union-attr, arg-type]
    schema = json.loads(plan("required", parallel_tool_calls=False).constraint().params.json)  # type: ignore[union-attr, arg-type]
    assert schema["minItems"] == schema["maxItems"] == 1
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [
        {"enum": ["weather"]}, {"enum": ["time"]}]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
    assert plan("required").tools == TOOLS


@pytest.mark.parametrize(("choice", "parser", "fields", "message"), [
    ("auto", None, {}, ("tool_choice 'auto' (the default with tools) needs a parser of the "
                        "model's tool-call format, and this server has none: start it with "
                        "--tool-call-parser (hermes)")),
    (None, None, {}, "tool_choice 'auto' (the default with tools) needs a parser"),
    ("sometimes", "hermes", {}, "tool_choice must be 'none', 'auto', 'required' or"),
    ({"type": "function", "function": {"name": "nope"}}, "hermes", {},
     "tool_choice names the function 'nope', which is not among the tools"),
    ({"type": "function", "name": "weather"}, "hermes", {}, "a named tool_choice is"),
    ("auto", "hermes", {"tools": TOOLS + TOOLS[:1]}, "tools name 'weather' more than once"),
])
def test_tool_fields_that_cannot_be_served_are_400s_that_say_why(
        choice: object, parser: str | None, fields: dict, message: str) -> None:
    with pytest.raises(ApiError) as raised:
        plan(choice, parser, **fields)
    assert raised.value.status == 400 and raised.value.message.startswith(message)
    assert raised.value.param == ("tools" if "tools" in fields else "tool_choice")


def test_tool_choice_without_tools_is_refused_unless_none() -> None:
    base = {"messages": [{"role": "user", "content": "hi"}]}
    assert tool_plan(ChatCompletionRequest.model_validate({**base, "tool_choice": "none"}),
                     None) is None
    with pytest.raises(ApiError, match="tool_choice needs tools"):
        tool_plan(ChatCompletionRequest.model_validate({**base, "tool_choice": "required"}),
                  None)


HERMES_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
)


def test_history_calls_and_tool_answers_reach_the_template() -> None:
    body = ChatCompletionRequest.model_validate({"tools": TOOLS[:1], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    conversation = conversation_of(body.messages)
    # Arguments given as JSON text reach the template as an object.
    assert conversation[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    text = render_chat(HERMES_TEMPLATE, conversation, add_generation_prompt=True,
                       special_tokens={}, extra={"tools": TOOLS[:1]})
    # (The template's own newlines after a block tag are trimmed.)
    assert text == (
        f"<tools>{json.dumps(TOOLS[:1])}</tools>\n<|user|>Weather in Paris?"
        '<|assistant|><tool_call>{"name": "weather", "arguments": {"city": "Paris"}}'
        "</tool_call><|tool|>sunny[call_1]")
