"""The FastAPI app of `kvferry serve` and its routes.

A pure-ASGI gate in front of the routes gives every request an id (the client's
`X-Request-Id` or a new one, returned in the response), checks the API key, answers 503
while the engine is loading, draining or dead, answers 413 to a body over the size limit
(before reading it when its Content-Length says so, else as soon as it grows past), and
counts the generation requests in
flight (streams included) so that a drain knows when they are done. The process lifecycle
(loading, SIGTERM drain, engine death) is in lifecycle.py.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import uuid
from importlib import metadata
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, FastAPI, File, Form, Request, UploadFile
from fastapi.responses import Response
from kvferry.engine.config import EngineConfig
from kvferry.engine.server.chat import chat_text, create_chat_completion
from kvferry.engine.server.completions import create_completion
from kvferry.engine.server.errors import (
    bad_request,
    error_response,
    install_error_handlers,
)
from kvferry.engine.server.metrics import PROMETHEUS_CONTENT_TYPE
from kvferry.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    conversation_of,
    now,
)
from kvferry.engine.server.serving import check_model
from kvferry.engine.server.state import ServerSettings, ServerState
from kvferry.engine.server.transcriptions import (
    AUDIO_PATH,
    TranscriptionForm,
    create_transcription,
    require_multipart,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from kvferry.engine.frontend.async_llm import AsyncLLM

__all__ = ["ServerSettings", "ServerState", "build_app", "serve"]

# Routes that need the API key and a serving engine.
API_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
# Routes whose requests a drain waits for.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", AUDIO_PATH})
# The endpoint whose bodies may carry prompt embeddings, and the field's name as JSON.
EMBEDS_PATH = "/v1/completions"
EMBEDS_FIELD = b'"prompt_embeds"'
# The flag of the size limit of most bodies.
MAX_BODY_FLAG = "--max-body-bytes"
# Requests whose bodies are not read.
_BODYLESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# A client's X-Request-Id is used when it is short and printable.
_REQUEST_ID_PATTERN = re.compile(r"^[\x21-\x7e]{1,128}$")


def version() -> str:
    try:
        return metadata.version("kvferry")
    except metadata.PackageNotFoundError:
        return "unknown"


class RequestGate:
    """Request ids, API key, availability (503) and the in-flight count, before any route."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        send = _with_request_id_header(send, request_id)
        path: str = scope["path"]
        if path.startswith(API_PREFIXES):
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        if scope["method"] not in _BODYLESS_METHODS:
            receive = await self._read_body(scope, receive, send)
            if receive is None:
                return
        if path not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        self.state.request_started()
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.request_finished()

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """The body read within the size limit, replayed to the app; None: a 413 was sent.

        The body is read here, whole, because the routes read it whole anyway (JSON, or a
        transcription's form), and a refusal from inside the app's body parsing would not
        reach the client as a 413.
        """
        settings = self.state.settings
        path = scope["path"]
        limit, flag = self._body_limit(path)
        length = _header(scope, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            await _too_large(limit, flag)(scope, receive, send)
            return None
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client left; the app sees an empty body and the disconnect
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _too_large(limit, flag)(scope, receive, send)
                return None
            parts.append(chunk)
            if not message.get("more_body"):
                break
        body = b"".join(parts)
        if path == EMBEDS_PATH and size > settings.max_body_bytes and EMBEDS_FIELD not in body:
            await _too_large(settings.max_body_bytes, MAX_BODY_FLAG)(scope, receive, send)
            return None
        return _replaying(body, receive)

    def _body_limit(self, path: str) -> tuple[int, str]:
        """The most bytes a body to `path` may have, and the flag that sets it."""
        settings = self.state.settings
        if path == AUDIO_PATH:
            return settings.max_audio_body_bytes, "--max-audio-body-bytes"
        if path != EMBEDS_PATH:
            return settings.max_body_bytes, MAX_BODY_FLAG
        # Past max_body_bytes only a body with prompt_embeds (checked once read).
        embeds_limit = settings.max_embeds_body_bytes or 0
        return (max(settings.max_body_bytes, embeds_limit),
                "--max-embeds-body-bytes for a body with prompt_embeds")

    def _refusal(self, scope: Scope) -> Response | None:
        api_key = self.state.settings.api_key
        if api_key is not None and not _has_key(scope, api_key):
            return error_response(401, "missing or wrong API key: send 'Authorization: Bearer "
                                       "<key>'", code="invalid_api_key")
        reason = self.state.unavailable_reason()
        if reason is not None:
            return error_response(503, reason, code="service_unavailable")
        return None


def _too_large(limit: int, flag: str) -> Response:
    return error_response(413, f"the request body is larger than the limit of {limit} bytes "
                               f"({flag})", code="request_too_large")


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A receive that gives `body` first, then the client's further messages (disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replay


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _request_id(scope: Scope) -> str:
    given = _header(scope, b"x-request-id")
    if given is not None and _REQUEST_ID_PATTERN.match(given):
        return given
    return uuid.uuid4().hex


def _has_key(scope: Scope, api_key: str) -> bool:
    header = _header(scope, b"authorization") or ""
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              api_key.encode())


def _with_request_id_header(send: Send, request_id: str) -> Send:
    async def send_with_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            headers.append((b"x-request-id", request_id.encode("latin-1")))
            message = {**message, "headers": headers}
        await send(message)

    return send_with_id


def build_app(state: ServerState) -> FastAPI:
    """The app over `state` (its engine may still be loading)."""
    app = FastAPI(title="kvferry", version=version(), docs_url="/docs", redoc_url=None)
    install_error_handlers(app)
    _add_generation_routes(app, state)
    _add_info_routes(app, state)
    _add_token_routes(app, state)
    _add_probe_routes(app, state)
    app.add_middleware(RequestGate, state=state)
    return app


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        state.note_unknown_fields("/v1/completions", body.unknown_fields())
        return await create_completion(state, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        state.note_unknown_fields("/v1/chat/completions", body.unknown_fields())
        return await create_chat_completion(state, body, request)

    @app.post(AUDIO_PATH, dependencies=[Depends(require_multipart)])
    async def transcriptions(
        request: Request,
        file: Annotated[UploadFile, File(description="the audio: WAV, FLAC or OGG")],
        model: Annotated[str, Form()],
        language: Annotated[str | None, Form()] = None,
        prompt: Annotated[str | None, Form()] = None,
        response_format: Annotated[str, Form()] = "json",
        temperature: Annotated[float, Form()] = 0.0,
        kv_transfer_params: Annotated[str | None, Form()] = None,
        stream: Annotated[bool, Form()] = False,
    ) -> Response:
        # An empty field (as an HTML form sends one left blank) is one not given.
        form = TranscriptionForm(model, language or None, prompt, response_format or "json",
                                 temperature, kv_transfer_params or None, stream)
        try:
            return await create_transcription(state, form, file, request)
        finally:
            await file.close()


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/models")
    async def models() -> ModelList:
        engine = state.engine
        assert engine is not None
        card = ModelCard(id=state.served_model_name, created=now(),
                         root=engine.config.model.model,
                         max_model_len=engine.input_processor.limits.max_model_len)
        return ModelList(data=[card])

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": version()}


def _add_token_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest) -> Response:
        engine = state.engine
        assert engine is not None
        check_model(body.model, state.served_model_name)
        if body.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
            text = chat_text(state, engine, conversation_of(body.messages),
                             body.add_generation_prompt, {"tools": tools} if tools else None)
            add_special_tokens = False  # the template holds them
        elif body.prompt is not None:
            text, add_special_tokens = body.prompt, body.add_special_tokens
        else:
            raise bad_request("send either 'prompt' (text) or 'messages'", param="prompt")
        # A long text takes seconds to tokenize, and its ids long to write as JSON: both on a
        # worker thread, so the server keeps answering meanwhile (probes and registry too).
        answer = await asyncio.to_thread(_tokenize_answer, engine, text, add_special_tokens,
                                         body.return_token_strs)
        return Response(answer, media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        engine = state.engine
        assert engine is not None
        check_model(body.model, state.served_model_name)
        vocab_size = engine.input_processor.limits.vocab_size
        for index, token in enumerate(body.tokens):
            if not 0 <= token < vocab_size:
                raise bad_request(f"tokens[{index}] = {token} is outside the vocabulary "
                                  f"[0, {vocab_size})", param="tokens")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens))


def _tokenize_answer(engine: AsyncLLM, text: str, add_special_tokens: bool,
                     return_token_strs: bool) -> bytes:
    """The /tokenize answer's JSON, made on a worker thread (`encode_in_thread`)."""
    ids = engine.tokenizer.encode_in_thread(text, add_special_tokens=add_special_tokens)
    strs = None
    if return_token_strs:
        strs = [engine.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    answer = TokenizeResponse(count=len(ids), tokens=ids, token_strs=strs,
                              max_model_len=engine.input_processor.limits.max_model_len)
    return answer.model_dump_json().encode()


def _add_probe_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        reason = state.unavailable_reason()
        if reason is not None:
            # No request log line: probes ask every second or so while a model loads, and
            # the state behind the answer is logged where it changes.
            return error_response(503, reason, code="service_unavailable")
        return Response(status_code=200)

    @app.get("/ping")
    async def ping() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = state.metrics.render() if state.metrics is not None else b""
        return Response(body, media_type=PROMETHEUS_CONTENT_TYPE)


def serve(config: EngineConfig, settings: ServerSettings) -> int:
    """Runs the server until it is drained or its engine dies; returns the exit code."""
    from kvferry.engine.server.lifecycle import run_server

    return run_server(config, settings)

