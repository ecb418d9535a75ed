"""POST /v1/completions: prompts in, completions out, whole or streamed as SSE chunks.

An encoder-decoder model whose encoder reads text (BART) takes each prompt as its encoder's
input; the decoder starts from the model's default decoder prompt ([decoder start, BOS]).
Its `usage.prompt_tokens` counts both prompts' tokens: the encoder prompt's, which grow with
what the client sent, and the decoder prompt's, which the model reads too. (vLLM counts only
the decoder prompt, the same two tokens whatever the input.) `echo` is refused, as the prompt
does not begin the output; `prompt_logprobs` score the decoder prompt. A model whose encoder
reads audio (Whisper) is served by /v1/audio/transcriptions only.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from kvferry.engine.frontend.async_llm import AsyncLLM
from kvferry.engine.frontend.input_processor import PROMPT_LOGPROBS_NEED_IDS, ProcessedPrompt
from kvferry.engine.frontend.outputs import Logprob, PromptLogprobs
from kvferry.engine.sampling_params import SamplingParams
from kvferry.engine.server.errors import ApiError, bad_request
from kvferry.engine.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
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
    sub_request_ids,
)
from kvferry.engine.server.state import ServerState
from kvferry.engine.server.structured import check_constraint, constraint_of
from kvferry.kvtransfer.params import KVTransferParams

from kvferry.protocol.errors import error_body


@dataclass
class CompletionJob:
    """One /v1/completions request, checked and ready to run."""

    body: CompletionRequest
    engine: AsyncLLM
    response_id: str
    model: str
    created: int
    prompts: list[ProcessedPrompt]
    params: SamplingParams
    record: RequestRecord
    # The body's kv_transfer_params as admitted (None: none, or refused and computed here).
    kv_transfer_params: KVTransferParams | None = None
    # The field that constrains the output (the param of a constraint's errors).
    constraint_param: str | None = None

    @property
    def request_ids(self) -> list[str]:
        return sub_request_ids(self.response_id, len(self.prompts))

    def choice_index(self, prompt_index: int, index: int) -> int:
        return prompt_index * self.params.n + index

    def prompt_text(self, prompt_index: int) -> str:
        prompt = self.prompts[prompt_index]
        if prompt.prompt is not None:
            return prompt.prompt
        return self.engine.tokenizer.decode(prompt.prompt_token_ids, skip_special_tokens=False)

    async def abort(self) -> None:
        for request_id in self.request_ids:
            await self.engine.abort(request_id)


async def create_completion(
    state: ServerState, body: CompletionRequest, request: Request
) -> Response:
    job = await prepare(state, body, request)
    await check_constraint(job.engine, job.params, job.constraint_param)
    if body.stream:
        return StreamingResponse(stream_completion(job, request), media_type="text/event-stream")
    return JSONResponse((await collect_completion(job, request)).model_dump())


async def prepare(state: ServerState, body: CompletionRequest, request: Request) -> CompletionJob:
    engine = state.engine
    assert engine is not None  # the middleware answers 503 until the engine is loaded
    record = RequestRecord(request.state.request_id, "completions")
    check_model(body.model, state.served_model_name)
    check_takes_text(engine, "/v1/completions")
    check_encoder_decoder_fields(engine, body)
    check_stop_limits(body.stop, state.settings.max_stop_strings, state.settings.max_stop_bytes)
    constraint = constraint_of(body)
    params = body.to_sampling_params(None if constraint is None else constraint.params)
    body.check_prompt_inputs()
    if body.prompt_embeds is not None:
        if params.prompt_logprobs is not None:
            raise bad_request(PROMPT_LOGPROBS_NEED_IDS, param="prompt_embeds")
        prompts = await _decode_embeds(engine, body.embeds_payloads())
    else:
        prompts = [_process(engine, p, body.add_special_tokens) for p in body.prompts()]
    check_request_fits(engine, prompts, params, "max_tokens")
    check_queue_room(engine, state.settings.max_num_waiting)
    kv_transfer_params = admit_kv_transfer_params(engine, body.kv_transfer_params)
    if params.prompt_logprobs is not None and kv_transfer_params is not None \
            and kv_transfer_params.do_remote_prefill:
        raise bad_request("prompt logprobs (prompt_logprobs, or echo with logprobs) need the "
                          "whole prompt computed on this pod: they cannot come with the "
                          "kv_transfer_params of a remote prefill", param="kv_transfer_params")
    record.num_prompt_tokens = sum(p.num_input_tokens for p in prompts)
    if state.settings.log_prompts:
        record.prompt_text = " | ".join(_loggable(p) for p in prompts)
    return CompletionJob(body, engine, random_id("cmpl"), state.served_model_name, now(),
                         prompts, params, record, kv_transfer_params,
                         None if constraint is None else constraint.param)


def check_encoder_decoder_fields(engine: AsyncLLM, body: CompletionRequest) -> None:
    """400 for what an encoder-decoder model cannot do: echo, which puts the prompt before
    the completion, while such a model's prompt goes to its encoder and its output starts
    from the decoder's own prompt."""
    if engine.input_processor.limits.is_encoder_decoder and body.echo:
        raise bad_request("echo is not possible with an encoder-decoder model: the prompt is "
                          "the encoder's input, not the start of the completion; send echo "
                          "false", param="echo")


async def _decode_embeds(engine: AsyncLLM, payloads: list[str]) -> list[ProcessedPrompt]:
    """Each payload decoded and checked (kvferry.protocol.prompt_embeds) on a worker thread:
    parsing, hashing and casting megabytes must not hold the event loop. A 400 names the
    payload and the check that refused it."""
    where = (["prompt_embeds"] if len(payloads) == 1
             else [f"prompt_embeds[{i}]" for i in range(len(payloads))])

    def decode_all() -> list[ProcessedPrompt]:
        return [engine.input_processor.decode_prompt_embeds(text, name)
                for text, name in zip(payloads, where)]

    try:
        return await asyncio.to_thread(decode_all)
    except ValueError as exc:
        raise bad_request(str(exc), param="prompt_embeds") from None


def _loggable(prompt: ProcessedPrompt) -> str:
    if prompt.prompt_embeds is not None:
        return f"<{prompt.num_tokens} rows of embeddings>"
    return prompt.prompt or str(prompt.prompt_token_ids)


def _process(engine: AsyncLLM, prompt: str | list[int], add_special_tokens: bool) -> ProcessedPrompt:
    if isinstance(prompt, str) and not add_special_tokens:
        check_text_fits(engine, prompt, "prompt")
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        return process_prompt(engine, {"prompt": prompt, "prompt_token_ids": ids}, "prompt")
    return process_prompt(engine, prompt, "prompt")


async def collect_completion(job: CompletionJob, request: Request) -> CompletionResponse:
    choices = {
        (p, i): ChoiceState() for p in range(len(job.prompts)) for i in range(job.params.n)
    }
    kv_transfer_params = None
    prompt_logprobs: dict[int, PromptLogprobs] = {}
    try:
        async with abort_on_disconnect(request.receive, job.abort):
            async for prompt_index, output in stream_outputs(
                job.engine, job.request_ids, job.prompts, job.params, job.body.priority,
                job.kv_transfer_params,
            ):
                kv_transfer_params = output.kv_transfer_params or kv_transfer_params
                if output.prompt_logprobs is not None:
                    prompt_logprobs[prompt_index] = output.prompt_logprobs
                for delta in output.outputs:
                    choices[(prompt_index, delta.index)].add(delta)
    except (ValueError, RuntimeError) as exc:
        job.record.error = str(exc)
        raise engine_error(exc) from None
    finally:
        job.record.finish(list(choices.values()))
        job.record.log()
    return CompletionResponse(
        id=job.response_id, created=job.created, model=job.model,
        choices=[_whole_choice(job, p, i, c, prompt_logprobs.get(p))
                 for (p, i), c in choices.items()],
        usage=UsageInfo.of(job.record.num_prompt_tokens, job.record.num_output_tokens),
        kv_transfer_params=kv_transfer_params,
    )


def _whole_choice(job: CompletionJob, prompt_index: int, index: int, choice: ChoiceState,
                  prompt_logprobs: PromptLogprobs | None) -> CompletionChoice:
    prefix = job.prompt_text(prompt_index) if job.body.echo else ""
    logprobs = None
    if job.params.logprobs is not None:
        logprobs = completion_logprobs(choice.token_ids, choice.logprobs, len(prefix))
        if job.body.echo:
            logprobs = _echoed(job, prompt_index, prompt_logprobs, logprobs)
    return CompletionChoice(
        index=job.choice_index(prompt_index, index), text=prefix + choice.text,
        logprobs=logprobs, finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
        prompt_logprobs=_prompt_logprobs_json(job, prompt_logprobs),
    )


def completion_logprobs(
    token_ids: list[int], positions: list[dict[int, Logprob] | None], text_offset: int,
    decode: Callable[[int], str] | None = None,
) -> CompletionLogprobs:
    """The legacy shape: per token its text, its offset in the choice's text, its logprob,
    and {text: logprob} of the alternatives. A position without logprobs (an echoed
    prompt's first token) has nulls, and its text from `decode`."""
    out = CompletionLogprobs()
    offset = text_offset
    for token_id, position in zip(token_ids, positions):
        if position is None:
            token = decode(token_id) if decode is not None else ""
            out.tokens.append(token)
            out.token_logprobs.append(None)
            out.text_offset.append(offset)
            out.top_logprobs.append(None)
            offset += len(token)
            continue
        sampled = position.get(token_id)
        token = (sampled.decoded_token if sampled else None) or ""
        out.tokens.append(token)
        out.token_logprobs.append(sampled.logprob if sampled else None)
        out.text_offset.append(offset)
        out.top_logprobs.append({(lp.decoded_token or ""): lp.logprob for lp in position.values()})
        offset += len(token)
    return out


def _echoed(job: CompletionJob, prompt_index: int, table: PromptLogprobs | None,
            completion: CompletionLogprobs) -> CompletionLogprobs:
    """echo with logprobs: the prompt's tokens first (the first without a logprob, as
    nothing comes before it), then the completion's."""
    prompt_ids = job.prompts[prompt_index].prompt_token_ids
    tokenizer = job.engine.tokenizer
    prompt = completion_logprobs(
        prompt_ids, table if table is not None else [None] * len(prompt_ids), 0,
        decode=lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))
    return CompletionLogprobs(
        text_offset=prompt.text_offset + completion.text_offset,
        token_logprobs=prompt.token_logprobs + completion.token_logprobs,
        tokens=prompt.tokens + completion.tokens,
        top_logprobs=prompt.top_logprobs + completion.top_logprobs,
    )


def _prompt_logprobs_json(job: CompletionJob, table: PromptLogprobs | None
                          ) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs` of a choice, when the request asked for them."""
    if job.body.prompt_logprobs is None or table is None:
        return None
    return [None if position is None else {
        str(token_id): PromptLogprob(logprob=lp.logprob, rank=lp.rank,
                                     decoded_token=lp.decoded_token)
        for token_id, lp in position.items()} for position in table]


async def stream_completion(job: CompletionJob, request: Request) -> AsyncIterator[bytes]:
    choices = {
        (p, i): ChoiceState() for p in range(len(job.prompts)) for i in range(job.params.n)
    }
    offsets = dict.fromkeys(choices, 0)
    body = job.body
    try:
        async with abort_on_disconnect(request.receive, job.abort):
            async for prompt_index, output in stream_outputs(
                job.engine, job.request_ids, job.prompts, job.params, body.priority,
                job.kv_transfer_params,
            ):
                for delta in output.outputs:
                    key = (prompt_index, delta.index)
                    choice = choices[key]
                    prefix, first = "", not choice.started
                    if first:
                        choice.started = True
                        prefix = job.prompt_text(prompt_index) if body.echo else ""
                    choice.add(delta)
                    text = prefix + delta.text
                    if not text and delta.finish_reason is None and not delta.logprobs:
                        continue  # held back: it may begin a stop string
                    logprobs = None
                    if job.params.logprobs is not None:
                        logprobs = completion_logprobs(
                            delta.token_ids, delta.logprobs or [], offsets[key] + len(prefix))
                        offsets[key] += len(prefix) + sum(len(t) for t in logprobs.tokens)
                        if first and body.echo:
                            logprobs = _echoed(job, prompt_index, output.prompt_logprobs,
                                               logprobs)
                    chunk = CompletionChoice(
                        index=job.choice_index(*key), text=text, logprobs=logprobs,
                        finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                        # The prompt's logprobs go once, with the choice's first chunk.
                        prompt_logprobs=_prompt_logprobs_json(job, output.prompt_logprobs)
                        if first else None)
                    # A prefill hop's params ride on the chunk that finishes it, as vLLM's
                    # streaming proxies read them.
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
        job.record.finish(list(choices.values()))
        job.record.log()
    yield SSE_DONE


def _chunk_json(job: CompletionJob, chunk_choices: list[CompletionChoice],
                choices: dict[tuple[int, int], ChoiceState], with_usage: bool,
                kv_transfer_params: dict[str, Any] | None = None) -> str:
    usage = None
    if with_usage:
        num_output = sum(len(c.token_ids) for c in choices.values())
        usage = UsageInfo.of(job.record.num_prompt_tokens, num_output)
    if usage is None and kv_transfer_params is None and len(chunk_choices) == 1 \
            and chunk_choices[0].logprobs is None and chunk_choices[0].prompt_logprobs is None:
        return _text_chunk_json(job, chunk_choices[0])
    response = CompletionResponse(id=job.response_id, created=job.created, model=job.model,
                                  choices=chunk_choices, usage=usage,
                                  kv_transfer_params=kv_transfer_params)
    return response.model_dump_json()


def _text_chunk_json(job: CompletionJob, choice: CompletionChoice) -> str:
    """The common chunk (one choice, text only) written directly: one per token per stream,
    so it skips building a model. Same fields and order as CompletionResponse's JSON."""
    return (
        f'{{"id":"{job.response_id}","object":"text_completion","created":{job.created},'
        f'"model":{json.dumps(job.model)},"choices":[{{"index":{choice.index},'
        f'"text":{json.dumps(choice.text)},"logprobs":null,'
        f'"finish_reason":{json.dumps(choice.finish_reason)},'
        f'"stop_reason":{json.dumps(choice.stop_reason)}}}],"usage":null}}'
    )
