"""POST /v1/chat/completions: messages rendered with the chat template, then generated like a
completion; answered whole or as `chat.completion.chunk` SSE events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from kvferry.engine.frontend.async_llm import AsyncLLM
from kvferry.engine.frontend.input_processor import ProcessedPrompt
from kvferry.engine.frontend.outputs import Logprob
from kvferry.engine.sampling_params import SamplingParams
from kvferry.engine.server.chat_template import render_chat
from kvferry.engine.server.errors import ApiError, bad_request
from kvferry.engine.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    TopLogprob,
    UsageInfo,
    now,
    random_id,
)
from kvferry.engine.server.serving import (
    SSE_DONE,
    ChoiceState,
    RequestRecord,
    abort_on_disconnect,
    admit_kv_transfer_params,
    check_model,
    check_queue_room,
    check_request_fits,
    check_stop_limits,
    check_takes_text,
    check_text_fits,
    engine_error,
    process_prompt,
    sse,
    stream_outputs,
)
from kvferry.engine.server.state import ServerState
from kvferry.engine.server.structured import Constraint, check_constraint, constraint_of
from kvferry.engine.server.tool_calls import (
    CallExtractor,
    Extracted,
    ToolPlan,
    finish_reason_of,
    tool_plan,
    whole_calls,
)
from kvferry.kvtransfer.params import KVTransferParams

from kvferry.protocol.errors import error_body


@dataclass
class ChatJob:
    """One chat request, rendered, checked and ready to run."""

    body: ChatCompletionRequest
    engine: AsyncLLM
    response_id: str
    model: str
    created: int
    prompt: ProcessedPrompt
    params: SamplingParams
    record: RequestRecord
    # The body's kv_transfer_params as admitted (None: none, or refused and computed here).
    kv_transfer_params: KVTransferParams | None = None
    # How the request's tools are served (None: it has none).
    tools: ToolPlan | None = None
    # The field that constrains the output (the param of a constraint's errors).
    constraint_param: str | None = None

    async def abort(self) -> None:
        await self.engine.abort(self.response_id)

    def extractor(self) -> CallExtractor | None:
        """A reader of tool calls for one choice, when the request's tools are parsed."""
        return self.tools.extractor() if self.tools and self.tools.extracts_calls else None


async def create_chat_completion(
    state: ServerState, body: ChatCompletionRequest, request: Request
) -> Response:
    job = prepare(state, body, request)
    await check_constraint(job.engine, job.params, job.constraint_param)
    if body.stream:
        return StreamingResponse(stream_chat(job, request), media_type="text/event-stream")
    return JSONResponse((await collect_chat(job, request)).model_dump())


def chat_prompt(state: ServerState, engine: AsyncLLM, messages: list[dict[str, object]],
                add_generation_prompt: bool,
                extra: dict[str, object] | None = None,
                fits_param: str | None = None) -> tuple[str, list[int]]:
    """The rendered conversation and its token ids (the template holds the special tokens).

    With `fits_param`, a conversation too long to fit the model is a 400 naming it, found
    before tokenizing.
    """
    text = chat_text(state, engine, messages, add_generation_prompt, extra)
    if fits_param is not None:
        check_text_fits(engine, text, fits_param)
    return text, engine.tokenizer.encode(text, add_special_tokens=False)


def chat_text(state: ServerState, engine: AsyncLLM, messages: list[dict[str, object]],
              add_generation_prompt: bool, extra: dict[str, object] | None = None) -> str:
    """The conversation rendered with the chat template (its special tokens as text)."""
    tokenizer = engine.tokenizer
    return render_chat(
        state.chat_template, messages, add_generation_prompt=add_generation_prompt,
        special_tokens={"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token},
        extra=extra,
    )


def prepare(state: ServerState, body: ChatCompletionRequest, request: Request) -> ChatJob:
    engine = state.engine
    assert engine is not None  # the middleware answers 503 until the engine is loaded
    record = RequestRecord(request.state.request_id, "chat")
    check_model(body.model, state.served_model_name)
    check_takes_text(engine, "/v1/chat/completions")
    check_stop_limits(body.stop, state.settings.max_stop_strings, state.settings.max_stop_bytes)
    tools = tool_plan(body, state.settings.tool_call_parser)
    constraint = _constraint(body, tools)
    params = body.to_sampling_params(None if constraint is None else constraint.params)
    text, ids = chat_prompt(state, engine, body.conversation(), body.add_generation_prompt,
                            template_context(body.chat_template_kwargs, tools), "messages")
    prompt = process_prompt(engine, {"prompt": text, "prompt_token_ids": ids}, "messages")
    max_tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None \
        else "max_tokens"
    check_request_fits(engine, [prompt], params, max_tokens_param)
    check_queue_room(engine, state.settings.max_num_waiting)
    kv_transfer_params = admit_kv_transfer_params(engine, body.kv_transfer_params)
    record.num_prompt_tokens = prompt.num_input_tokens
    if state.settings.log_prompts:
        record.prompt_text = text
    return ChatJob(body, engine, random_id("chatcmpl"), state.served_model_name, now(),
                   prompt, params, record, kv_transfer_params, tools,
                   None if constraint is None else constraint.param)


def _constraint(body: ChatCompletionRequest, tools: ToolPlan | None) -> Constraint | None:
    """The output's constraint: a forced tool call's, or the structured-output fields'."""
    asked = constraint_of(body)
    forced = None if tools is None else tools.constraint()
    if asked is not None and forced is not None:
        raise bad_request(f"tool_choice {body.tool_choice!r} and {asked.param} each constrain "
                          "the output; give one of them", param=asked.param)
    return forced or asked


def template_context(kwargs: dict[str, Any] | None, tools: ToolPlan | None
                     ) -> dict[str, Any] | None:
    """What the chat template gets beside the messages: the tools, then chat_template_kwargs."""
    if tools is None:
        return kwargs
    return {"tools": tools.tools, **(kwargs or {})}


async def collect_chat(job: ChatJob, request: Request) -> ChatCompletionResponse:
    choices = [ChoiceState() for _ in range(job.params.n)]
    kv_transfer_params = None
    try:
        async with abort_on_disconnect(request.receive, job.abort):
            async for _, output in stream_outputs(
                job.engine, [job.response_id], [job.prompt], job.params, job.body.priority,
                job.kv_transfer_params,
            ):
                kv_transfer_params = output.kv_transfer_params or kv_transfer_params
                for delta in output.outputs:
                    choices[delta.index].add(delta)
    except (ValueError, RuntimeError) as exc:
        job.record.error = str(exc)
        raise engine_error(exc) from None
    finally:
        job.record.finish(choices)
        job.record.log()
    return ChatCompletionResponse(
        id=job.response_id, created=job.created, model=job.model,
        choices=[_whole_choice(job, i, c) for i, c in enumerate(choices)],
        usage=UsageInfo.of(job.record.num_prompt_tokens, job.record.num_output_tokens),
        kv_transfer_params=kv_transfer_params,
    )


def _whole_choice(job: ChatJob, index: int, choice: ChoiceState) -> ChatChoice:
    """A choice's message: its text, or the tool calls in it and the text around them."""
    message = ChatResponseMessage(content=choice.text)
    finish_reason = choice.finish_reason
    extractor = job.extractor()
    if extractor is not None:
        assert job.tools is not None
        found = extractor.feed(choice.text)
        found += extractor.finish()
        calls = whole_calls(found.calls)
        content = found.content if found.content.strip() or not calls else None
        message = ChatResponseMessage(content=content, tool_calls=calls or None)
        finish_reason = finish_reason_of(job.tools, extractor, finish_reason)
    return ChatChoice(index=index, message=message,
                      logprobs=_logprobs(job, choice.token_ids, choice.logprobs),
                      finish_reason=finish_reason, stop_reason=choice.stop_reason)


def _logprobs(job: ChatJob, token_ids: list[int],
              positions: list[dict[int, Logprob]] | None) -> ChatLogprobs | None:
    if job.params.logprobs is None:
        return None
    return chat_logprobs(token_ids, positions or [], job.params.logprobs)


def chat_logprobs(token_ids: list[int], positions: list[dict[int, Logprob]],
                  num_top: int) -> ChatLogprobs:
    """Per token: its text, logprob and UTF-8 bytes, and the `num_top` most likely tokens."""
    content = []
    for token_id, position in zip(token_ids, positions):
        sampled = position.get(token_id)
        token = (sampled.decoded_token if sampled else None) or ""
        top = sorted(position.values(), key=lambda lp: lp.rank)[:num_top]
        content.append(ChatTokenLogprob(
            token=token, logprob=sampled.logprob if sampled else float("-inf"),
            bytes=list(token.encode()),
            top_logprobs=[
                TopLogprob(token=lp.decoded_token or "", logprob=lp.logprob,
                           bytes=list((lp.decoded_token or "").encode()))
                for lp in top
            ],
        ))
    return ChatLogprobs(content=content)


async def stream_chat(job: ChatJob, request: Request) -> AsyncIterator[bytes]:
    choices = [ChoiceState() for _ in range(job.params.n)]
    extractors = [job.extractor() for _ in range(job.params.n)]
    body = job.body
    try:
        async with abort_on_disconnect(request.receive, job.abort):
            async for _, output in stream_outputs(
                job.engine, [job.response_id], [job.prompt], job.params, body.priority,
                job.kv_transfer_params,
            ):
                for delta in output.outputs:
                    choice = choices[delta.index]
                    if not choice.started:
                        choice.started = True
                        first = ChatChunkChoice(index=delta.index,
                                                delta=ChatDelta(role="assistant", content=""))
                        yield sse(_chunk_json(job, [first], choices, False))
                    choice.add(delta)
                    piece, finish_reason = _stream_piece(job, extractors[delta.index], delta.text,
                                                         delta.finish_reason)
                    if not piece.content and not piece.calls and finish_reason is None \
                            and not delta.logprobs:
                        continue  # held back: it may begin a stop string (or a tool call)
                    chunk = ChatChunkChoice(
                        index=delta.index,
                        delta=ChatDelta(content=piece.content if piece.content or not piece.calls
                                        else None, tool_calls=piece.calls or None),
                        logprobs=_logprobs(job, delta.token_ids, delta.logprobs),
                        finish_reason=finish_reason, stop_reason=delta.stop_reason)
                    # A prefill hop's params ride on the chunk that finishes it.
                    kv_params = output.kv_transfer_params if delta.finish_reason else None
                    yield sse(_chunk_json(job, [chunk], choices, body.continuous_usage,
                                          kv_params))
        if body.include_usage:
            yield sse(_chunk_json(job, [], choices, True))
    except (ValueError, RuntimeError, ApiError) as exc:
        job.record.error = str(exc)
        error = exc if isinstance(exc, ApiError) else engine_error(exc)
        yield sse(json.dumps(error_body(error.status, error.message, error.param, error.code)))
    finally:
        job.record.finish(choices)
        job.record.log()
    yield SSE_DONE


def _stream_piece(job: ChatJob, extractor: CallExtractor | None, text: str,
                  finish_reason: str | None) -> tuple[Extracted, str | None]:
    """What a delta of a choice adds to its stream: content and calls, and the finish."""
    if extractor is None:
        return Extracted(content=text), finish_reason
    assert job.tools is not None
    piece = extractor.feed(text)
    if finish_reason is not None:
        piece += extractor.finish()
        finish_reason = finish_reason_of(job.tools, extractor, finish_reason)
    return piece, finish_reason


def _chunk_json(job: ChatJob, chunk_choices: list[ChatChunkChoice], choices: list[ChoiceState],
                with_usage: bool, kv_transfer_params: dict[str, Any] | None = None) -> str:
    usage = None
    if with_usage:
        usage = UsageInfo.of(job.record.num_prompt_tokens,
                             sum(len(c.token_ids) for c in choices))
    if usage is None and kv_transfer_params is None and len(chunk_choices) == 1 \
            and chunk_choices[0].logprobs is None and chunk_choices[0].delta.role is None \
            and chunk_choices[0].delta.tool_calls is None:
        return _content_chunk_json(job, chunk_choices[0])
    chunk = ChatCompletionChunk(id=job.response_id, created=job.created, model=job.model,
                                choices=chunk_choices, usage=usage,
                                kv_transfer_params=kv_transfer_params)
    return chunk.model_dump_json()


def _content_chunk_json(job: ChatJob, choice: ChatChunkChoice) -> str:
    """The common chunk (one choice, content only) written directly: one per token per
    stream, so it skips building a model. Same fields and order as ChatCompletionChunk's."""
    return (
        f'{{"id":"{job.response_id}","object":"chat.completion.chunk","created":{job.created},'
        f'"model":{json.dumps(job.model)},"choices":[{{"index":{choice.index},'
        f'"delta":{{"content":{json.dumps(choice.delta.content)}}},"logprobs":null,'
        f'"finish_reason":{json.dumps(choice.finish_reason)},'
        f'"stop_reason":{json.dumps(choice.stop_reason)}}}],"usage":null}}'
    )
