"""POST /v1/audio/transcriptions: OpenAI's multipart form in, a Whisper transcript out.

The form's fields are OpenAI's: `file` (WAV, FLAC or OGG), `model`, `language`, `prompt`,
`response_format` (json, text or verbose_json) and `temperature`. Everything a request can
get wrong is refused with a 400 before the engine sees it: the body's content type, a
missing field (FastAPI's validation), a model that does not take audio, an unknown format
or language, and a file that is not audio, is empty or lasts longer than the model's chunk.
Reading and decoding the file, resampling it and tokenizing the prompt run on a worker
thread. The body's size is capped before it reaches the route (`--max-audio-body-bytes`,
api_server.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
from fastapi import Request, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from kvferry.engine.frontend.audio import WhisperAudio, decode_audio
from kvferry.engine.frontend.input_processor import ProcessedPrompt
from kvferry.engine.frontend.outputs import RequestOutput
from kvferry.engine.frontend.tokenizer import Tokenizer
from kvferry.engine.frontend.whisper_prompt import TRANSCRIBE, WhisperTokens, whisper_languages
from kvferry.engine.sampling_params import SamplingParams
from kvferry.engine.server.errors import ApiError, bad_request, error_body
from kvferry.engine.server.serving import (
    SSE_DONE,
    ChoiceState,
    RequestRecord,
    abort_on_disconnect,
    admit_kv_transfer_params,
    check_model,
    check_output_error,
    check_queue_room,
    engine_error,
    sse,
)

if TYPE_CHECKING:
    from kvferry.engine.frontend.async_llm import AsyncLLM
    from kvferry.kvtransfer.params import KVTransferParams
    from kvferry.engine.server.state import ServerState

AUDIO_PATH = "/v1/audio/transcriptions"
RESPONSE_FORMATS = ("json", "text", "verbose_json")
# OpenAI's range for a transcription's temperature.
MAX_TEMPERATURE = 1.0
# Whisper never emits these; a bias this low keeps them from being sampled.
SUPPRESS_BIAS = -100.0


@dataclass(frozen=True)
class TranscriptionForm:
    """The form's fields other than the file, as sent."""

    model: str
    language: str | None = None
    prompt: str | None = None
    response_format: str = "json"
    temperature: float = 0.0
    # The hop's transfer params as JSON text (disaggregation: an encoder pod's hold, or a
    # request to hold), as the router sends them.
    kv_transfer_params: str | None = None
    # Stream the transcript as OpenAI's transcript.text.delta / .done events.
    stream: bool = False


@dataclass
class TranscriptionInputs:
    """A transcription's audio and decoder prompt, checked: what goes to the engine."""

    # The language's code ("en"); None for an English-only model.
    language: str | None
    # Mono samples at the model's own rate (so the engine only computes the features).
    samples: np.ndarray
    sample_rate: int
    # The audio's length as sent, in seconds.
    duration_s: float
    decoder_prompt: list[int]
    params: SamplingParams
    # The engine's prompt, features computed (set off the event loop before generating).
    processed: ProcessedPrompt | None = None


@dataclass(frozen=True)
class Transcriber:
    """What the route needs of a Whisper checkpoint, loaded once with the engine; its
    checks raise the client's 400s."""

    audio: WhisperAudio
    tokens: WhisperTokens

    @classmethod
    def load(cls, model_dir: str, tokenizer: Tokenizer) -> Transcriber:
        """Reads the checkpoint's preprocessor and generation configs (slow: it imports
        transformers; call it off the event loop). ValueError names what is missing."""
        return cls(WhisperAudio(model_dir), WhisperTokens.from_checkpoint(model_dir, tokenizer))

    def check_form(self, form: TranscriptionForm) -> str | None:
        """The fields other than the file, checked; the language's code."""
        if form.response_format not in RESPONSE_FORMATS:
            raise bad_request(f"response_format {form.response_format!r} is not supported; "
                              f"use {', '.join(RESPONSE_FORMATS)}", param="response_format")
        if not 0.0 <= form.temperature <= MAX_TEMPERATURE:
            raise bad_request(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got "
                              f"{form.temperature}", param="temperature")
        try:
            return self.tokens.language_code(form.language)
        except ValueError as exc:
            raise bad_request(str(exc), param="language") from None

    def read_inputs(self, form: TranscriptionForm, data: bytes, tokenizer: Tokenizer,
                    max_model_len: int) -> TranscriptionInputs:
        """The file decoded, checked and resampled, the prompt tokenized, and the sampling
        params. Up to seconds of work (a long file, a long prompt): run it on a worker
        thread. 400s name `file`, `prompt` or the form's other fields."""
        language = self.check_form(form)
        try:
            samples, rate = decode_audio(data, max_seconds=self.audio.max_seconds)
            prepared = self.audio.prepare(samples, rate)
        except ValueError as exc:
            raise bad_request(str(exc), param="file") from None
        previous_ids = self._previous_ids(form.prompt, tokenizer)
        decoder_prompt = self.tokens.decoder_prompt(language, TRANSCRIBE, previous_ids)
        params = self._sampling_params(form, decoder_prompt, max_model_len)
        return TranscriptionInputs(language, prepared, self.audio.sampling_rate,
                                   samples.size / rate, decoder_prompt, params)

    def _previous_ids(self, prompt: str | None, tokenizer: Tokenizer) -> list[int]:
        if not prompt or not prompt.strip():
            return []
        if self.tokens.start_of_previous is None:
            raise bad_request("this model takes no prompt (it has no <|startofprev|> token)",
                              param="prompt")
        try:
            return self.tokens.previous_text_ids(tokenizer, prompt)
        except ValueError as exc:
            raise bad_request(str(exc), param="prompt") from None

    def _sampling_params(self, form: TranscriptionForm, decoder_prompt: list[int],
                         max_model_len: int) -> SamplingParams:
        """Up to the decoder's context; Whisper's suppressed tokens biased away; the sampled
        tokens' logprobs for verbose_json's avg_logprob."""
        max_tokens = max_model_len - len(decoder_prompt)
        if max_tokens < 1:
            raise bad_request(f"the prompt leaves no room for a transcript: the decoder prompt "
                              f"has {len(decoder_prompt)} tokens, the model's context "
                              f"{max_model_len}", param="prompt")
        suppressed = self.tokens.suppress_tokens
        return SamplingParams(
            temperature=form.temperature, max_tokens=max_tokens,
            logprobs=0 if form.response_format == "verbose_json" else None,
            logit_bias=dict.fromkeys(suppressed, SUPPRESS_BIAS) if suppressed else None,
        )


@dataclass
class TranscriptionJob:
    """One transcription, checked and ready for the engine."""

    engine: AsyncLLM
    request_id: str
    response_format: str
    inputs: TranscriptionInputs
    record: RequestRecord
    kv_transfer_params: KVTransferParams | None = None
    # Returned by the engine with the last output (an encoder pod's hold).
    returned_params: dict[str, Any] | None = None


def require_multipart(request: Request) -> None:
    """400 unless the body is a multipart form (run before the form's fields are checked,
    so a JSON body is told what it should be rather than that every field is missing)."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";", 1)[0].strip().lower() != "multipart/form-data":
        raise bad_request(f"{AUDIO_PATH} takes a multipart/form-data body (the file and the "
                          f"fields as form parts), got content type {content_type or 'none'!r}")


async def create_transcription(state: ServerState, form: TranscriptionForm, upload: UploadFile,
                               request: Request) -> Response:
    job = await prepare(state, form, upload, request)
    # An encoder hop (do_remote_decode) always answers whole: its answer is the params.
    holds = job.kv_transfer_params is not None and job.kv_transfer_params.do_remote_decode
    if form.stream and not holds:
        return StreamingResponse(stream_transcript(job, request),
                                 media_type="text/event-stream")
    choice = await collect(job, request)
    if job.returned_params is not None:
        # An encoder pod's answer: the hold's params for the decode hop, always as JSON.
        return JSONResponse({"text": choice.text.strip(),
                             "kv_transfer_params": job.returned_params})
    return render(job.response_format, job.inputs, choice)


async def prepare(state: ServerState, form: TranscriptionForm, upload: UploadFile,
                  request: Request) -> TranscriptionJob:
    """Every check, so that each 400 comes before the engine is called."""
    engine = state.engine
    assert engine is not None  # the middleware answers 503 until the engine is loaded
    record = RequestRecord(request.state.request_id, "transcriptions")
    check_model(form.model, state.served_model_name)
    transcriber = state.transcriber
    if transcriber is None:
        raise bad_request(f"this model does not take audio: {AUDIO_PATH} needs a Whisper "
                          f"model, and this server serves {engine.info.architecture}",
                          param="model")
    transcriber.check_form(form)  # the cheap checks, before the file is read
    kv_transfer_params = admit_kv_transfer_params(engine, _form_json(form.kv_transfer_params))
    check_queue_room(engine, state.settings.max_num_waiting)
    data = await upload.read()
    inputs = await asyncio.to_thread(transcriber.read_inputs, form, data, engine.tokenizer,
                                     engine.input_processor.limits.max_model_len)
    # The log-mel features too are computed on the worker thread, not in generate().
    try:
        processed = await asyncio.to_thread(engine.input_processor.process_prompt,
                                            whisper_prompt(inputs))
    except ValueError as exc:
        raise bad_request(str(exc), param="file") from None
    if processed.encoder is not None:
        # Keyed by the file's bytes: a router computes the same key from the upload.
        processed.encoder = msgspec.structs.replace(
            processed.encoder, source_digest=hashlib.sha256(data).digest())
    inputs.processed = processed
    record.num_prompt_tokens = len(inputs.decoder_prompt)
    return TranscriptionJob(engine, request.state.request_id, form.response_format, inputs,
                            record, kv_transfer_params)


def _form_json(text: str | None) -> dict[str, Any] | None:
    """The kv_transfer_params form field: JSON text of an object (400 otherwise)."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        raise bad_request("kv_transfer_params must be JSON text of an object",
                          param="kv_transfer_params") from None
    if not isinstance(value, dict):
        raise bad_request("kv_transfer_params must be JSON text of an object",
                          param="kv_transfer_params")
    return value


def whisper_prompt(inputs: TranscriptionInputs) -> dict[str, Any]:
    """The engine's prompt of a Whisper request: the audio for the encoder, the ids for the
    decoder."""
    return {"encoder_prompt": {"multi_modal_data": {"audio": (inputs.samples,
                                                              inputs.sample_rate)}},
            "decoder_prompt": inputs.decoder_prompt}


async def transcribe(job: TranscriptionJob) -> AsyncIterator[RequestOutput]:
    """The engine's outputs of one transcription; leaving early aborts it."""
    prompt = job.inputs.processed or whisper_prompt(job.inputs)
    generator = job.engine.generate(job.request_id, prompt, job.inputs.params,
                                    kv_transfer_params=job.kv_transfer_params)
    try:
        async for output in generator:
            check_output_error(output)
            yield output
    finally:
        await generator.aclose()


async def collect(job: TranscriptionJob, request: Request) -> ChoiceState:
    """The whole transcript; a client that goes away aborts it."""
    choice = ChoiceState()

    async def abort() -> None:
        await job.engine.abort(job.request_id)

    try:
        async with abort_on_disconnect(request.receive, abort):
            async for output in transcribe(job):
                for delta in output.outputs:
                    choice.add(delta)
                if output.kv_transfer_params is not None:
                    job.returned_params = output.kv_transfer_params
    except (ValueError, RuntimeError) as exc:
        job.record.error = str(exc)
        raise engine_error(exc) from None
    except ApiError as exc:
        job.record.error = exc.message
        exc.is_logged = True
        raise
    finally:
        job.record.finish([choice])
        job.record.log()
    return choice


async def stream_transcript(job: TranscriptionJob, request: Request) -> AsyncIterator[bytes]:
    """OpenAI's streamed transcription: a transcript.text.delta event per piece of text as
    the model writes it, then transcript.text.done with the whole text and the usage. A
    failure after the first event ends the stream with an error event."""
    choice = ChoiceState()
    try:
        async with abort_on_disconnect(request.receive, lambda: job.engine.abort(job.request_id)):
            async for output in transcribe(job):
                for delta in output.outputs:
                    choice.add(delta)
                    # The first piece loses the space Whisper's first token starts with.
                    text = delta.text.lstrip() if choice.text == delta.text else delta.text
                    if text:
                        yield sse(json.dumps({"type": "transcript.text.delta", "delta": text}))
        usage = {"type": "duration", "seconds": round(job.inputs.duration_s, 3)}
        yield sse(json.dumps({"type": "transcript.text.done", "text": choice.text.strip(),
                              "usage": usage}))
        yield SSE_DONE
    except (ValueError, RuntimeError, ApiError) as exc:
        job.record.error = str(exc)
        error = exc if isinstance(exc, ApiError) else engine_error(exc)
        yield sse(json.dumps(error_body(error.status, error.message, error.param, error.code)))
    finally:
        job.record.finish([choice])
        job.record.log()


def render(response_format: str, inputs: TranscriptionInputs, choice: ChoiceState) -> Response:
    """The answer in the requested format. The text loses the space Whisper's first token
    starts with, as OpenAI's does. The usage of json and verbose_json is OpenAI's for a
    model billed by the audio's length: its duration in seconds."""
    text = choice.text.strip()
    if response_format == "text":
        return PlainTextResponse(text)
    duration = round(inputs.duration_s, 3)
    usage = {"type": "duration", "seconds": duration}
    if response_format == "json":
        return JSONResponse({"text": text, "usage": usage})
    return JSONResponse({
        "task": TRANSCRIBE,
        "language": whisper_languages().get(inputs.language or "en", "english"),
        "duration": duration,
        "text": text,
        "segments": [_segment(inputs, choice, text, duration)],
        "usage": usage,
    })


def _segment(inputs: TranscriptionInputs, choice: ChoiceState, text: str,
             duration: float) -> dict[str, Any]:
    """The whole transcript as one segment, as the model wrote it without timestamps.
    (no_speech_prob is left out: the probability of <|nospeech|> is not computed.)"""
    logprobs = [p[t].logprob for t, p in zip(choice.token_ids, choice.logprobs) if t in p]
    encoded = text.encode()
    return {
        "id": 0,
        "seek": 0,
        "start": 0.0,
        "end": duration,
        "text": text,
        "tokens": choice.token_ids,
        "temperature": inputs.params.temperature,
        "avg_logprob": sum(logprobs) / len(logprobs) if logprobs else 0.0,
        # How repetitive the text is (openai-whisper's sign of a hallucination).
        "compression_ratio": len(encoded) / len(zlib.compress(encoded)) if encoded else 0.0,
    }
