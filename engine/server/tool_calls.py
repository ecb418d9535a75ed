"""Tool calls of chat completions: `tools`, `tool_choice`, `parallel_tool_calls`.

How each `tool_choice` is served (as vLLM serves it):

- a named function: the output is constrained to the function's arguments (its
  `parameters` schema) and returned as one call of that function (finish_reason "stop",
  as OpenAI answers a forced call);
- "required": the output is constrained to a JSON array of one or more
  `{"name": ..., "parameters": {...}}` objects, one per call (one at most when
  `parallel_tool_calls` is false), returned as calls (finish_reason "tool_calls");
- "auto" (the default when tools are given): the model writes free text, and a parser of the
  model's own tool-call format finds the calls in it (`--tool-call-parser`; `hermes`:
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, as Hermes, Qwen 2.5/3
  and many others write them). Without a parser, "auto" is a 400 that says so;
- "none": the tools are shown to the model (through the chat template) and nothing is
  parsed.

In every case the tools reach the chat template as `tools`, in OpenAI's shape. Extraction
is incremental (`CallExtractor.feed`), so a stream carries content as it comes and each call
as soon as it is known; a whole answer is the same extraction run at once.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Self

from kvferry.engine.sampling_params import StructuredOutputsParams
from kvferry.engine.server.errors import bad_request
from kvferry.engine.server.protocol import (
    ChatCompletionRequest,
    FunctionCall,
    FunctionCallDelta,
    FunctionDefinition,
    ToolCall,
    ToolCallDelta,
)
from kvferry.engine.server.state import TOOL_CALL_PARSERS
from kvferry.engine.server.structured import Constraint

TOOL_CHOICES = ("none", "auto", "required")
# The arguments of a function that declares no parameters: any JSON object.
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """How one request's tools are served."""

    # "none", "auto", "required" or "named".
    mode: str
    # The tools as the chat template reads them (OpenAI's shape).
    tools: list[dict[str, Any]]
    # The function a named tool_choice forces.
    named: FunctionDefinition | None = None
    # False: at most one call.
    parallel: bool = True
    # The tool-call parser of "auto".
    parser: str | None = None

    @property
    def extracts_calls(self) -> bool:
        return self.mode != "none"

    def constraint(self) -> Constraint | None:
        """The output constraint of a named or required tool_choice."""
        if self.mode == "named":
            assert self.named is not None
            spec = StructuredOutputsParams(json=self.named.parameters or ANY_OBJECT,
                                           strict=self.named.strict is not False)
            return Constraint(spec, "tool_choice")
        if self.mode == "required":
            return Constraint(StructuredOutputsParams(json=self._required_schema()),
                              "tool_choice")
        return None

    def _required_schema(self) -> dict[str, Any]:
        calls = [{
            "type": "object",
            "properties": {"name": {"enum": [tool["function"]["name"]]},
                           "parameters": tool["function"].get("parameters") or ANY_OBJECT},
            "required": ["name", "parameters"], "additionalProperties": False,
        } for tool in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def extractor(self) -> CallExtractor:
        """A fresh extractor for one choice's output."""
        if self.mode == "named":
            assert self.named is not None
            return NamedCall(self.named.name)
        if self.mode == "required":
            return RequiredCalls(self.parallel)
        return HermesCalls(self.parallel)


def tool_plan(body: ChatCompletionRequest, parser: str | None) -> ToolPlan | None:
    """How the request's tools are served; None without tools. A 400 names a bad field."""
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice is not None and choice != "none":
            raise bad_request("tool_choice needs tools: the request gives none",
                              param="tool_choice")
        return None
    names = [tool.function.name for tool in tools]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise bad_request(f"tools name {', '.join(map(repr, duplicates))} more than once",
                          param="tools")
    as_template = [tool.model_dump(exclude_none=True) for tool in tools]
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, dict):
        named = _named_function(choice, body)
        return ToolPlan("named", as_template, named=named, parallel=parallel)
    mode = "auto" if choice is None else choice
    if mode not in TOOL_CHOICES:
        raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or "
                          f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                          f"got {choice!r}", param="tool_choice")
    if mode == "auto" and parser is None:
        raise bad_request(
            "tool_choice 'auto' (the default with tools) needs a parser of the model's "
            "tool-call format, and this server has none: start it with --tool-call-parser "
            f"({', '.join(TOOL_CALL_PARSERS)}), or send tool_choice 'required', 'none' or a "
            "named function", param="tool_choice")
    return ToolPlan(mode, as_template, parallel=parallel, parser=parser)


def _named_function(choice: dict[str, Any], body: ChatCompletionRequest) -> FunctionDefinition:
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request('a named tool_choice is {"type": "function", "function": {"name": '
                          f'...}}}}, got {json.dumps(choice)}', param="tool_choice")
    for tool in body.tools or ():
        if tool.function.name == name:
            return tool.function
    raise bad_request(f"tool_choice names the function {name!r}, which is not among the "
                      "tools", param="tool_choice")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------------- extraction
@dataclass
class Extracted:
    """What a piece of output adds: content text and pieces of calls."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: Extracted) -> Self:
        self.content += other.content
        self.calls += other.calls
        return self


class CallExtractor:
    """Reads one choice's output as it grows: `feed` each new piece, `finish` at its end."""

    def feed(self, text: str) -> Extracted:
        raise NotImplementedError

    def finish(self) -> Extracted:
        raise NotImplementedError

    @property
    def num_calls(self) -> int:
        raise NotImplementedError


def _call_start(index: int, name: str, arguments: str) -> ToolCallDelta:
    return ToolCallDelta(index=index, id=new_call_id(), type="function",
                         function=FunctionCallDelta(name=name, arguments=arguments))


def _arguments_text(arguments: Any) -> str:
    """Arguments as JSON text, in the separators constrained output uses."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


class NamedCall(CallExtractor):
    """A forced call: the whole output is the function's arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    @property
    def num_calls(self) -> int:
        return 1

    def feed(self, text: str) -> Extracted:
        if not text:
            return Extracted()
        if not self.started:
            self.started = True
            return Extracted(calls=[_call_start(0, self.name, text)])
        return Extracted(calls=[ToolCallDelta(index=0, function=FunctionCallDelta(arguments=text))])

    def finish(self) -> Extracted:
        if self.started:
            return Extracted()
        self.started = True
        return Extracted(calls=[_call_start(0, self.name, "")])


class RequiredCalls(CallExtractor):
    """Calls from the constrained array `[{"name": ..., "parameters": {...}}, ...]`: each call
    goes out as soon as its object closes. Output that never closes one stays content."""

    def __init__(self, parallel: bool) -> None:
        self.parallel = parallel
        self.buffer = ""
        # Where the next unread call object may start in `buffer`.
        self.position = 0
        self.calls = 0
        self._decoder = json.JSONDecoder()

    @property
    def num_calls(self) -> int:
        return self.calls

    def feed(self, text: str) -> Extracted:
        self.buffer += text
        out = Extracted()
        while True:
            start = _skip(self.buffer, self.position, "[, \t\r\n")
            if start >= len(self.buffer) or self.buffer[start] != "{":
                return out
            try:
                item, end = self._decoder.raw_decode(self.buffer, start)
            except ValueError:
                return out  # the object is not closed yet
            self.position = end
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                continue
            if self.parallel or self.calls == 0:
                out.calls.append(_call_start(self.calls, item["name"],
                                             _arguments_text(item.get("parameters", {}))))
                self.calls += 1

    def finish(self) -> Extracted:
        return Extracted(content=self.buffer) if self.calls == 0 else Extracted()


def _skip(text: str, position: int, characters: str) -> int:
    while position < len(text) and text[position] in characters:
        position += 1
    return position


class HermesCalls(CallExtractor):
    """Hermes-style calls in free text: `<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>`. Text around the blocks is content; a block that is not such a JSON object
    stays content too. Content that may begin a `<tool_call>` is held back until it is known."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, parallel: bool) -> None:
        self.parallel = parallel
        self.buffer = ""
        self.in_call = False
        self.calls = 0

    @property
    def num_calls(self) -> int:
        return self.calls

    def feed(self, text: str) -> Extracted:
        self.buffer += text
        out = Extracted()
        while True:
            if not self.in_call:
                start = self.buffer.find(self.START)
                if start < 0:
                    held = _partial_prefix(self.buffer, self.START)
                    out.content += self.buffer[:len(self.buffer) - held]
                    self.buffer = self.buffer[len(self.buffer) - held:]
                    return out
                out.content += self.buffer[:start]
                self.buffer = self.buffer[start + len(self.START):]
                self.in_call = True
            end = self.buffer.find(self.END)
            if end < 0:
                return out
            out += self._call(self.buffer[:end])
            self.buffer = self.buffer[end + len(self.END):]
            self.in_call = False

    def finish(self) -> Extracted:
        text, self.buffer = self.buffer, ""
        if not self.in_call:
            return Extracted(content=text)
        # The output ended inside a block (no closing tag): a complete call still counts.
        self.in_call = False
        return self._call(text)

    def _call(self, body: str) -> Extracted:
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return Extracted(content=f"{self.START}{body}{self.END}")
        if not self.parallel and self.calls:
            return Extracted()
        delta = _call_start(self.calls, call["name"], _arguments_text(call.get("arguments", {})))
        self.calls += 1
        return Extracted(calls=[delta])


def _partial_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (it may be completed later)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def whole_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """The calls that streamed pieces add up to (a piece's arguments extend its call's)."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        function = delta.function or FunctionCallDelta()
        call = calls.get(delta.index)
        if call is None:
            calls[delta.index] = ToolCall(id=delta.id or new_call_id(), function=FunctionCall(
                name=function.name or "", arguments=function.arguments or ""))
        elif function.arguments:
            call.function.arguments = str(call.function.arguments) + function.arguments
    return [calls[index] for index in sorted(calls)]


def finish_reason_of(plan: ToolPlan, extractor: CallExtractor, finish_reason: str | None
                     ) -> str | None:
    """OpenAI's finish reason: "tool_calls" when the model chose to call ("auto" or
    "required") and stopped on its own; a forced (named) call keeps "stop"."""
    if finish_reason == "stop" and plan.mode in ("auto", "required") and extractor.num_calls:
        return "tool_calls"
    return finish_reason
