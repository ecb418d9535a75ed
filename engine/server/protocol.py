"""Request and response bodies of the OpenAI API (and vLLM's extensions), as pydantic models.

Requests are checked in two layers. The models check types and integer ranges (so nothing
the engine cannot encode gets through); `SamplingParams` checks values, with messages that
name the field and the limit. Both failures become 400s naming the field.

Types are strict, as the OpenAI API's are: integers are JSON integers (not `true`, `5.0` or
`"5"`), numbers are integers or floats (not strings or booleans), booleans are `true` or
`false`. The router checks the same fields with `kvferry.protocol.request_checks`, which
must agree with these models (a test holds the two together).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from kvferry.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvferry.engine.server.errors import bad_request
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    Strict,
    model_serializer,
    model_validator,
)

from kvferry.protocol.request_checks import (
    INT64_MAX,
    INT64_MIN,
    InvalidRequest,
    check_prompt_inputs,
    check_unicode,
)
from kvferry.protocol.request_fields import CHAT, COMPLETIONS, check_refused, unknown_names

# Integers cross to the engine core as msgpack, which holds 64 bits; `Strict` refuses
# booleans, floats and strings where an integer belongs.
Int64 = Annotated[int, Strict(), Field(ge=INT64_MIN, le=INT64_MAX)]
# A number: a JSON integer or float (strict floats take integers, not strings or booleans).
Number = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]
# Completions per prompt; each is a sequence in the engine, so a request cannot ask for many.
MAX_N = 128
# The most prompts one /v1/completions request may batch.
MAX_NUM_PROMPTS = 1024

# A prompt: text, a batch of texts, token ids, or a batch of token id lists.
PromptInput = str | list[str] | list[Int64] | list[list[Int64]]


class OpenAIModel(BaseModel):
    """Unknown fields are ignored (clients send fields of newer API versions); NaN and
    infinities are refused."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class RequestBody(OpenAIModel):
    """A request body; its text must be Unicode that the tokenizer can take (see
    `check_unicode`: a lone UTF-16 surrogate is a 400 naming its field, found before the
    body is parsed, instead of a failure deep in the tokenizer or the detokenizer)."""

    # The generation endpoint whose refused fields (`request_fields.REFUSED`) this body's
    # model checks; None for other bodies.
    _endpoint: ClassVar[str | None] = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates_and_refused_fields(cls, data: Any) -> Any:
        try:
            check_unicode(data)
            if cls._endpoint is not None and isinstance(data, dict):
                check_refused(cls._endpoint, data)
        except InvalidRequest as exc:
            raise bad_request(str(exc), param=exc.param) from None
        return data

    def unknown_fields(self) -> list[str]:
        """Names in the body that no schema has (kept aside by `extra="allow"`), less the
        accepted and refused ones that `request_fields` lists."""
        if self._endpoint is None or not self.model_extra:
            return []
        return unknown_names(self._endpoint, self.model_extra, frozenset())


class StreamOptions(OpenAIModel):
    # Send one more chunk, with empty choices and the request's usage, before [DONE].
    include_usage: Bool = False
    # Put the usage so far in every chunk.
    continuous_usage_stats: Bool = False


class JsonSchemaFormat(OpenAIModel):
    """`response_format.json_schema`: OpenAI's named schema."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    # False: schema keywords the grammar engine cannot enforce are ignored; true or absent:
    # they are a 400 (every other keyword is enforced either way).
    strict: Bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's `response_format`: text, any JSON object, or a JSON schema."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIModel):
    """vLLM's `structured_outputs`: exactly one constraint. Options kvferry does not act on
    are refused by name (extra fields forbidden), not ignored."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: Bool | None = None
    # Generated JSON has no free whitespace anyway, so true is honoured and false asks for
    # nothing the output lacks.
    disable_any_whitespace: Bool = False
    # kvferry runs one grammar engine: there is nothing to fall back to.
    disable_fallback: Bool = False


class SamplingRequest(RequestBody):
    """The sampling and streaming fields that completions and chat share."""

    model: str | None = None
    n: Annotated[int, Strict(), Field(le=MAX_N)] = 1
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: Int64 | None = None
    min_p: Number | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    repetition_penalty: Number = 1.0
    ignore_eos: Bool = False
    min_tokens: Int64 = 0
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    stream: Bool = False
    stream_options: StreamOptions | None = None
    # Lower runs earlier when the server schedules by priority.
    priority: Int64 = 0
    user: str | None = None
    # Structured outputs (engine/server/structured.py): OpenAI's field, vLLM's field and
    # vLLM's older guided_* spellings; at most one of them per request.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # OpenAI's: token id (a JSON object key, so a string) -> bias in [-100, 100].
    logit_bias: dict[str, Number] | None = None
    # vLLM's: only these token ids may be sampled.
    allowed_token_ids: list[Int64] | None = None
    # Disaggregated serving, vLLM's shape: {"do_remote_decode": true} on a prefill pod;
    # the params a prefill returned on a decode pod (see kvferry.kvtransfer.params).
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(
            self.stream and self.stream_options and self.stream_options.continuous_usage_stats
        )

    def build_sampling_params(
        self, max_tokens: int | None, logprobs: int | None,
        prompt_logprobs: int | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The engine's params; a refused value raises a 400 naming the field."""
        try:
            return SamplingParams(
                n=self.n,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logit_bias=self._logit_bias(),
                allowed_token_ids=self.allowed_token_ids,
                prompt_logprobs=prompt_logprobs,
                structured_outputs=structured_outputs,
            )
        except ValueError as exc:
            raise bad_request(str(exc), param=param_of_message(str(exc))) from None


    def _logit_bias(self) -> dict[int, float] | None:
        """The bias with integer token ids; a key that is not one is a 400."""
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()):
                raise bad_request(f"logit_bias keys must be token ids (decimal integers), got "
                                  f"{key[:40]!r}", param="logit_bias")
            bias[int(key)] = value
        return bias


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def param_of_message(message: str) -> str | None:
    """The field a `SamplingParams` message names: its first word ("stop[0]" -> "stop")."""
    word = message.split(" ", 1)[0].split("[", 1)[0]
    return word if word in _SAMPLING_FIELDS else None


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    _endpoint: ClassVar[str | None] = COMPLETIONS

    # One of prompt and prompt_embeds (check_prompt_inputs).
    prompt: PromptInput | None = None
    # vLLM's: the prompt as embeddings, base64 of the bytes torch.save(tensor) writes for a
    # (num_tokens, hidden_size) tensor; a list of them is a batch (--enable-prompt-embeds).
    prompt_embeds: str | list[str] | None = None
    max_tokens: Int64 | None = 16
    # Alternatives per position (0 = only the sampled token's logprob).
    logprobs: Int64 | None = None
    # Put the prompt in front of each completion's text.
    echo: Bool = False
    # vLLM's: logprobs of the prompt's tokens, with this many alternatives each.
    prompt_logprobs: Int64 | None = None
    add_special_tokens: Bool = True

    def to_sampling_params(
        self, structured_outputs: StructuredOutputsParams | None = None
    ) -> SamplingParams:
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            # The echoed prompt's tokens get logprobs too, with as many alternatives.
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        return self.build_sampling_params(self.max_tokens, self.logprobs, prompt_logprobs,
                                          structured_outputs)

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: one string or token-id list per prompt."""
        prompt = self.prompt
        if prompt is None:
            return []  # the prompt is prompt_embeds (check_prompt_inputs said which)
        if isinstance(prompt, str):
            batch: list[str | list[int]] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            batch = [list(prompt)]  # type: ignore[arg-type]
        else:
            batch = list(prompt)  # type: ignore[arg-type]
        if not batch:
            raise bad_request("prompt must not be empty", param="prompt")
        if len(batch) > MAX_NUM_PROMPTS:
            raise bad_request(
                f"prompt holds {len(batch)} prompts, more than the limit of {MAX_NUM_PROMPTS}",
                param="prompt",
            )
        return batch

    def embeds_payloads(self) -> list[str]:
        """The batch of prompts given as embeddings: one base64 payload per prompt."""
        embeds = self.prompt_embeds
        batch = [] if embeds is None else [embeds] if isinstance(embeds, str) else list(embeds)
        if not batch:
            raise bad_request("prompt_embeds must not be empty", param="prompt_embeds")
        if len(batch) > MAX_NUM_PROMPTS:
            raise bad_request(f"prompt_embeds holds {len(batch)} prompts, more than the limit "
                              f"of {MAX_NUM_PROMPTS}", param="prompt_embeds")
        return batch

    def check_prompt_inputs(self) -> None:
        """400 unless exactly one of prompt and prompt_embeds is given."""
        try:
            check_prompt_inputs(self.prompt, self.prompt_embeds)
        except InvalidRequest as exc:
            raise bad_request(str(exc), param=exc.param) from None


class ContentPart(OpenAIModel):
    """One part of a message's content; only text parts are supported."""

    type: str
    text: str | None = None


class FunctionCall(OpenAIModel):
    """A call's function: its name and its arguments as JSON text (an object is taken too)."""

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(OpenAIModel):
    """A tool call of an assistant message, in a request's history or in a response."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant turn's calls, and a `tool` turn's answer to one of them.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self, index: int) -> str:
        """The content as one string (text parts joined with newlines)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part_index, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"content part of type {part.type!r} is not supported: only 'text' parts "
                    "with a 'text' field are", param=f"messages[{index}].content[{part_index}]",
                )
            texts.append(part.text)
        return "\n".join(texts)


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    # The JSON schema of the arguments; absent: any JSON object.
    parameters: dict[str, Any] | None = None
    # As `response_format.json_schema.strict`, for the arguments' schema.
    strict: Bool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    _endpoint: ClassVar[str | None] = CHAT

    messages: list[ChatMessage]
    # Deprecated by OpenAI in favour of max_completion_tokens; still honoured.
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: Bool = False
    top_logprobs: Int64 | None = None
    # End the rendered conversation with the header of an assistant turn.
    add_generation_prompt: Bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool calls (engine/server/tool_calls.py): "none", "auto", "required" or
    # {"type": "function", "function": {"name": ...}}; absent with tools means "auto".
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None

    def to_sampling_params(
        self, structured_outputs: StructuredOutputsParams | None = None
    ) -> SamplingParams:
        if not self.messages:
            raise bad_request("messages must hold at least one message", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
        num_logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        return self.build_sampling_params(max_tokens, num_logprobs,
                                          structured_outputs=structured_outputs)

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as plain dicts for the chat template."""
        return conversation_of(self.messages)


def conversation_of(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template reads them: role and text content, and the name, tool
    calls and tool call id when given. A call's arguments are an object there (JSON text
    that parses is parsed), as templates that render them with `tojson` expect."""
    out = []
    for index, message in enumerate(messages):
        entry: dict[str, Any] = {"role": message.role, "content": message.text(index)}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls is not None:
            entry["tool_calls"] = [_template_call(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


def _template_call(call: ToolCall) -> dict[str, Any]:
    arguments: Any = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # the template gets the text as it came
    return {"id": call.id, "type": call.type,
            "function": {"name": call.function.name, "arguments": arguments}}


class TokenizeRequest(RequestBody):
    """POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Rendered with the messages, as a chat request with these tools would be.
    tools: list[ChatTool] | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True
    return_token_strs: Bool = False


class DetokenizeRequest(RequestBody):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[Int64]


# ---- responses -------------------------------------------------------------------------


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogprobs(OpenAIModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIModel):
    """vLLM's prompt logprob of one candidate token at one prompt position."""

    logprob: float
    rank: int
    decoded_token: str | None = None


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's extension: the stop string or token id that ended the completion.
    stop_reason: int | str | None = None
    # vLLM's extension, with prompt_logprobs: per prompt position (None for the first),
    # token id -> its logprob; left out of the JSON when not asked for.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("prompt_logprobs") is None:
            data.pop("prompt_logprobs", None)
        return data


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    # From a prefill pod: the params the decode hop must carry.
    kv_transfer_params: dict[str, Any] | None = None


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    # The calls the reply makes; left out of the JSON when it makes none.
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class ChatChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    # From a prefill pod: the params the decode hop must carry.
    kv_transfer_params: dict[str, Any] | None = None


class FunctionCallDelta(OpenAIModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallDelta(OpenAIModel):
    """A streamed piece of a tool call: the first carries its id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatDelta(OpenAIModel):
    """A chunk's new content; only the first chunk of a choice carries the role."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(OpenAIModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    # On the finishing chunk of a streamed prefill hop: the params the decode hop must carry.
    kv_transfer_params: dict[str, Any] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset_params(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Chunks of every other stream keep the OpenAI shape.
        data = handler(self)
        if data.get("kv_transfer_params") is None:
            data.pop("kv_transfer_params", None)
        return data


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvferry"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(OpenAIModel):
    prompt: str
