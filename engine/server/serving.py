"""What completions and chat share: prompts checked against the engine, a request's outputs
as one stream, abort on disconnect, per-choice accumulation, and the request's log line."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kvferry.engine.core.messages import EngineLimits
from kvferry.engine.frontend.async_llm import AsyncLLM, EngineDeadError, QueueFullError
from kvferry.engine.frontend.input_processor import ProcessedPrompt, PromptType
from kvferry.engine.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from kvferry.engine.sampling_params import SamplingParams
from kvferry.engine.server.errors import ApiError, bad_request, request_logger, unavailable
from kvferry.engine.server.protocol import param_of_message
from kvferry.kvtransfer.params import KVTransferParams
from starlette.types import Receive

logger = request_logger


def check_model(requested: str | None, served_name: str) -> None:
    """404 unless the request names the served model (or no model at all)."""
    if requested is not None and requested != served_name:
        raise ApiError(404, f"the model {requested!r} does not exist; this server serves "
                            f"{served_name!r}", param="model", code="model_not_found")


def takes_audio(limits: EngineLimits) -> bool:
    """Whether the engine's model has an encoder that reads audio (Whisper)."""
    return limits.is_encoder_decoder and limits.encoder_input == "audio"


def check_takes_text(engine: AsyncLLM, endpoint: str) -> None:
    """400 naming `model` when the model's encoder reads audio: a text endpoint cannot
    serve it (its prompts have nothing for the encoder)."""
    if takes_audio(engine.input_processor.limits):
        raise bad_request(f"this model's encoder reads audio: {endpoint} cannot serve it; send "
                          "the audio to /v1/audio/transcriptions", param="model")


def check_stop_limits(stop: str | list[str] | None, max_strings: int, max_bytes: int) -> None:
    """400 naming `stop` when a request gives more stop strings, or more bytes of them, than
    the server takes (`--max-stop-strings`, `--max-stop-bytes`)."""
    if stop is None:
        return
    strings = [stop] if isinstance(stop, str) else stop
    if len(strings) > max_strings:
        raise bad_request(f"stop holds {len(strings)} strings, more than the limit of "
                          f"{max_strings} (--max-stop-strings)", param="stop")
    num_bytes = sum(len(s.encode()) for s in strings)
    if num_bytes > max_bytes:
        raise bad_request(f"stop holds {num_bytes} bytes of text, more than the limit of "
                          f"{max_bytes} (--max-stop-bytes)", param="stop")


def process_prompt(engine: AsyncLLM, prompt: PromptType, param: str) -> ProcessedPrompt:
    """Tokenized and checked against the model's limits; a 400 naming `param` otherwise."""
    try:
        return engine.input_processor.process_prompt(prompt)
    except ValueError as exc:
        raise bad_request(str(exc), param=param) from None


def admit_kv_transfer_params(engine: AsyncLLM,
                             data: dict[str, Any] | None) -> KVTransferParams | None:
    """The request's transfer params as this pod will act on them (None: none, or refused
    and computed here); a 400 for params it refuses. Decided before a stream starts, so a
    streamed request is refused with a status, not with an error event."""
    try:
        return engine.input_processor.admit_kv_transfer_params(data)
    except ValueError as exc:
        raise bad_request(str(exc), param="kv_transfer_params") from None


def check_text_fits(engine: AsyncLLM, text: str, param: str) -> None:
    """400 naming `param` when `text` cannot fit max_model_len, found without tokenizing it."""
    try:
        engine.input_processor.check_text_fits(text)
    except ValueError as exc:
        raise bad_request(str(exc), param=param) from None


def check_request_fits(
    engine: AsyncLLM, prompts: list[ProcessedPrompt], params: SamplingParams,
    max_tokens_param: str,
) -> None:
    """400 when prompt + max_tokens passes max_model_len or a token id is not in the vocabulary."""
    limits = engine.input_processor.limits
    try:
        limits.check_params(params)
    except ValueError as exc:
        raise bad_request(str(exc), param=param_of_message(str(exc))) from None
    if params.max_tokens is None:
        return
    longest = max(p.num_tokens for p in prompts)
    if longest + params.max_tokens > limits.max_model_len:
        raise bad_request(
            f"{max_tokens_param} is too large: the prompt has {longest} tokens and "
            f"{longest} + {params.max_tokens} passes the maximum model length of "
            f"{limits.max_model_len}", param=max_tokens_param,
        )


def check_queue_room(engine: AsyncLLM, max_num_waiting: int | None) -> None:
    """429 while the engine's waiting queue is at or past `--max-num-waiting`."""
    if max_num_waiting is None:
        return
    num_waiting = engine.num_waiting_sequences()
    if num_waiting >= max_num_waiting:
        raise ApiError(429, f"{num_waiting} requests are waiting for the engine, at or past "
                            f"the limit of {max_num_waiting}; retry later",
                       code="queue_full")


def check_output_error(output: RequestOutput) -> None:
    """Raises the error the engine gave a request (a failed KV transfer), if any."""
    if output.error is not None:
        raise ApiError(502, output.error, code="kv_transfer_failed")


def sub_request_ids(request_id: str, num_prompts: int) -> list[str]:
    """Engine ids of the prompts of one HTTP request."""
    if num_prompts == 1:
        return [request_id]
    return [f"{request_id}-{i}" for i in range(num_prompts)]


async def stream_outputs(
    engine: AsyncLLM, request_ids: list[str], prompts: list[ProcessedPrompt],
    params: SamplingParams, priority: int, kv_transfer_params: KVTransferParams | None = None,
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, delta output) of every prompt of a request, as they arrive.

    One prompt is iterated directly; several are pumped by one task each into a queue.
    Leaving early (an error, a disconnect) aborts every prompt still running. An output
    carrying the engine's error (a failed KV pull under policy `fail`) raises ApiError.
    """
    if len(prompts) == 1:
        generator = engine.generate(request_ids[0], prompts[0], params, priority=priority,
                                    kv_transfer_params=kv_transfer_params)
        try:
            async for output in generator:
                check_output_error(output)
                yield 0, output
        finally:
            await generator.aclose()
        return
    if kv_transfer_params:
        raise bad_request("kv_transfer_params need a single prompt",
                          param="kv_transfer_params")
    async for item in _merge(engine, request_ids, prompts, params, priority):
        yield item


async def _merge(
    engine: AsyncLLM, request_ids: list[str], prompts: list[ProcessedPrompt],
    params: SamplingParams, priority: int,
) -> AsyncIterator[tuple[int, RequestOutput]]:
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for output in engine.generate(request_ids[index], prompts[index], params,
                                                priority=priority):
                queue.put_nowait((index, output))
        except (ValueError, RuntimeError) as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i)) for i in range(len(prompts))]
    try:
        num_done = 0
        while num_done < len(tasks):
            item = await queue.get()
            if item is None:
                num_done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def engine_error(exc: BaseException) -> ApiError:
    """The HTTP error of an engine failure."""
    if isinstance(exc, QueueFullError):
        error = ApiError(429, str(exc), code="queue_full")
    elif isinstance(exc, EngineDeadError):
        error = unavailable(f"the engine is not available: {exc}")
    elif isinstance(exc, ValueError):
        error = bad_request(str(exc), param=param_of_message(str(exc)))
    else:
        error = ApiError(500, f"internal error: {type(exc).__name__}")
    # Raised from a generation whose own log line says what happened.
    error.is_logged = True
    return error


@contextlib.asynccontextmanager
async def abort_on_disconnect(
    receive: Receive, abort: Callable[[], Awaitable[None]]
) -> AsyncIterator[None]:
    """While the body runs, a client that goes away aborts the request at once.

    The request body has been read, so the next ASGI message is the disconnect.
    """

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                await abort()
                return

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


@dataclass
class ChoiceState:
    """What one choice (one completion of one prompt) has produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Streaming: whether the first chunk (role, echo) went out.
    started: bool = False

    def add(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


@dataclass
class RequestRecord:
    """One request's numbers for its INFO log line (no prompt text unless asked)."""

    request_id: str
    endpoint: str
    start: float = field(default_factory=time.monotonic)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    error: str | None = None
    prompt_text: str | None = None

    def finish(self, choices: list[ChoiceState]) -> None:
        """Takes the token counts and finish reasons of the request's choices; a choice that
        never finished was cut off by an error or by the client going away."""
        self.num_output_tokens = sum(len(c.token_ids) for c in choices)
        cut_off = "error" if self.error else "abort"
        self.finish_reasons = [c.finish_reason or cut_off for c in choices]

    def log(self) -> None:
        latency = time.monotonic() - self.start
        reasons = ",".join(sorted(set(self.finish_reasons))) or "-"
        extra = f" error={self.error!r}" if self.error else ""
        if self.prompt_text is not None:
            extra += f" prompt={self.prompt_text!r}"
        logger.info("request_id=%s endpoint=%s prompt_tokens=%d output_tokens=%d "
                    "finish_reason=%s latency_s=%.3f%s", self.request_id, self.endpoint,
                    self.num_prompt_tokens, self.num_output_tokens, reasons, latency, extra)


def sse(payload: str) -> bytes:
    """One server-sent event carrying `payload`."""
    return f"data: {payload}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
