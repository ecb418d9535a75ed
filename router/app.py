"""The router's HTTP app: the engine server's endpoints, answered through the pools.

A pure-ASGI gate before the routes gives each request an id (the client's X-Request-Id or
a new one), checks the API key and refuses bodies over the size limit before they are read.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import itertools
import json
import logging
import re
import signal
import uuid
from collections.abc import AsyncGenerator, Coroutine, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from kvferry.router.config import RouterSettings
from kvferry.router.flow import Answer, Router
from kvferry.router.hops import TRANSPORT_ERRORS, HopError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import kvferry
from kvferry.http_protocol import uvicorn_options
from kvferry.protocol.errors import error_body, http_error_message
from kvferry.protocol.request_checks import InvalidRequest

if TYPE_CHECKING:
    from kvferry.engine.frontend.tokenizer import Tokenizer

logger = logging.getLogger("kvferry.router")

API_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
PASSTHROUGH_TIMEOUT_S = 10.0
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_REQUEST_ID_PATTERN = re.compile(r"^[\x21-\x7e]{1,128}$")


def error_json(status: int, message: str, code: str | None = None,
               param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# Whisper's multipart form: relayed (through the encode hop) from one copy of the upload.
AUDIO_PATH = "/v1/audio/transcriptions"
# The endpoint whose bodies may carry prompt embeddings, and the field's name as JSON.
EMBEDS_PATH = "/v1/completions"
EMBEDS_FIELD = b'"prompt_embeds"'
# The last event of an OpenAI stream.
SSE_DONE = b"data: [DONE]\n\n"
# How long a stream runs before the router starts watching for its client leaving.
WATCH_DISCONNECT_AFTER_S = 0.05


class Gate:
    """Request id, API key and body size before anything reads the body; then the generation
    endpoints, answered in plain ASGI (the hot path: no framework request or response
    objects, no task per streamed answer), and everything else through FastAPI."""

    def __init__(self, app: ASGIApp, router: Router) -> None:
        self.app = app
        self.router = router
        self.keys = [k.encode() for k in router.settings.api_keys]
        self.max_body_bytes = router.settings.max_body_bytes
        # /v1/completions bodies carrying prompt_embeds may be this large.
        self.max_embeds_body_bytes = max(router.settings.max_embeds_body_bytes,
                                         self.max_body_bytes)
        # A transcription's form, its audio file included.
        self.max_audio_body_bytes = router.settings.max_audio_body_bytes
        # Request ids: a random prefix per router process and a counter (unique across
        # routers and restarts, without a uuid4's urandom call and object per request).
        self._id_prefix = uuid.uuid4().hex[:16]
        self._id_counter = itertools.count()
        # Requests being answered, by path: what a drain waits for.
        self.in_flight: collections.Counter[str] = collections.Counter()

    def _new_id(self) -> str:
        return f"{self._id_prefix}{next(self._id_counter):016x}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        self.in_flight[path] += 1
        try:
            await self._handle(path, scope, receive, send)
        finally:
            self.in_flight[path] -= 1
            if not self.in_flight[path]:
                del self.in_flight[path]

    def describe_in_flight(self) -> str:
        """What is being answered now, e.g. "3 requests (/v1/completions 2, /tokenize 1)"."""
        total = sum(self.in_flight.values())
        if not total:
            return "no request"
        paths = ", ".join(f"{path} {n}" for path, n in self.in_flight.most_common())
        return f"{total} request{'s' if total > 1 else ''} ({paths})"

    async def _handle(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope.get("headers", ()))
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = given if given and _REQUEST_ID_PATTERN.match(given) else self._new_id()
        scope.setdefault("state", {})["request_id"] = request_id
        refusal = self._refusal(path, headers)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        if path in GENERATION_PATHS:
            if scope["method"] != "POST":
                await _send_error(send, 405, "Method Not Allowed", None,
                                  request_id, [(b"allow", b"POST")])
                return
            await self._generate(path, receive, send, request_id)
            return
        if path == AUDIO_PATH:
            if scope["method"] != "POST":
                await _send_error(send, 405, "Method Not Allowed", None,
                                  request_id, [(b"allow", b"POST")])
                return
            content_type = headers.get(b"content-type", b"").decode("latin-1")
            await self._transcribe(content_type, receive, send, request_id)
            return
        await self.app(scope, _limited(receive, self.max_body_bytes), send)

    def _refusal(self, path: str, headers: dict[bytes, bytes]) -> Response | None:
        if self.keys and path.startswith(API_PREFIXES) and not self._has_key(headers):
            return error_json(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                              code="invalid_api_key")
        length = headers.get(b"content-length")
        limit = self._body_limit(path)
        if length is not None and length.isdigit() and int(length) > limit:
            return _too_large(limit, _limit_flag(path, limit != self.max_body_bytes))
        return None

    def _body_limit(self, path: str) -> int:
        """The most bytes a body may have: past max_body_bytes only a /v1/completions body
        with prompt_embeds (checked once it is read), and a transcription's form up to
        max_audio_body_bytes."""
        if path == AUDIO_PATH:
            return self.max_audio_body_bytes
        return self.max_embeds_body_bytes if path == EMBEDS_PATH else self.max_body_bytes

    def _has_key(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        token = token.strip()
        # Compare with every key (no early exit), so timing does not tell which one is near.
        found = False
        for key in self.keys:
            found |= hmac.compare_digest(token, key)
        return scheme.lower() == b"bearer" and found

    async def _generate(self, endpoint: str, receive: Receive, send: Send,
                        request_id: str) -> None:
        router = self.router
        limit = self._body_limit(endpoint)
        try:
            raw = await _read_body(receive, limit)
            if len(raw) > self.max_body_bytes and EMBEDS_FIELD not in raw:
                limit = self.max_body_bytes
                raise BodyTooLarge()
        except BodyTooLarge:
            flag = ("--max-body-bytes" if limit == self.max_body_bytes
                    else "--max-embeds-body-bytes for a body with prompt_embeds")
            await _send_error(send, 413, f"the request body is larger than {limit} bytes "
                              f"({flag})", "request_too_large", request_id)
            return
        try:
            answer = await _unless_client_leaves(receive, self._answer(endpoint, raw,
                                                                       request_id))
        except ClientGone:
            router.metrics.requests.labels(endpoint, "499").inc()
            return
        except HopError as exc:
            router.metrics.requests.labels(endpoint, str(exc.status)).inc()
            if exc.pod_error is not None:  # the pod's own error object, as the pod sent it
                await _send_json(send, exc.status, exc.pod_error, request_id)
                return
            await _send_error(send, exc.status, str(exc), exc.code, request_id)
            return
        except InvalidRequest as exc:  # refused as the engine pods refuse it
            router.metrics.requests.labels(endpoint, "400").inc()
            await _send_error(send, 400, str(exc), None, request_id, param=exc.param)
            return
        except ValueError as exc:  # the body is not a JSON object
            router.metrics.requests.labels(endpoint, "400").inc()
            await _send_error(send, 400, str(exc), "invalid_json", request_id)
            return
        router.metrics.requests.labels(endpoint, str(answer.status)).inc()
        await _send_answer(send, receive, answer, request_id)

    async def _transcribe(self, content_type: str, receive: Receive, send: Send,
                          request_id: str) -> None:
        """A transcription's form: read once (up to --max-audio-body-bytes) into the one
        buffer every hop sends views of."""
        router = self.router
        try:
            body = await _read_upload(receive, self.max_audio_body_bytes)
        except BodyTooLarge:
            await _send_error(send, 413, f"the request body is larger than "
                              f"{self.max_audio_body_bytes} bytes (--max-audio-body-bytes)",
                              "request_too_large", request_id)
            return
        except ClientGone:
            router.metrics.requests.labels(AUDIO_PATH, "499").inc()
            return
        try:
            answer = await _unless_client_leaves(
                receive, router.transcribe(content_type, body, request_id))
        except ClientGone:
            router.metrics.requests.labels(AUDIO_PATH, "499").inc()
            return
        except HopError as exc:
            router.metrics.requests.labels(AUDIO_PATH, str(exc.status)).inc()
            if exc.pod_error is not None:
                await _send_json(send, exc.status, exc.pod_error, request_id)
                return
            await _send_error(send, exc.status, str(exc), exc.code, request_id)
            return
        router.metrics.requests.labels(AUDIO_PATH, str(answer.status)).inc()
        await _send_answer(send, receive, answer, request_id)

    async def _answer(self, endpoint: str, raw: bytes, request_id: str) -> Answer:
        if self.router.can_relay_raw(raw):
            return await self.router.relay_raw(endpoint, raw, request_id)
        return await self.router.generate(endpoint, _json_object(raw), request_id, raw)


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


async def _unless_client_leaves(receive: Receive, work: Coroutine[Any, Any, Answer]) -> Answer:
    """Runs `work` (the hops up to a whole answer, or a stream's first chunk) in this task;
    ClientGone, with `work` cancelled, if the client disconnects meanwhile.

    Cancelling the hop closes its connection to the pod, and the pod aborts the request
    instead of generating a whole non-streamed answer for no one. Watching for the
    disconnect costs a task, so it starts once the work has lasted WATCH_DISCONNECT_AFTER_S
    (a timer until then): a quick answer costs nothing more.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    watcher: asyncio.Future[None] | None = None
    is_working = True
    is_gone = False

    def on_disconnect(done: asyncio.Future[None]) -> None:
        nonlocal is_gone
        # Only while `work` runs: once it is over, the relay watches for itself.
        if is_working and not done.cancelled() and done.exception() is None:
            is_gone = True
            task.cancel()

    def watch() -> None:
        nonlocal watcher
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        watcher.add_done_callback(on_disconnect)

    timer = loop.call_later(WATCH_DISCONNECT_AFTER_S, watch)
    try:
        return await work
    except asyncio.CancelledError:
        if is_gone and task.uncancel() == 0:
            raise ClientGone() from None
        raise
    finally:
        is_working = False
        timer.cancel()
        if watcher is not None:
            watcher.cancel()


def _json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; ValueError says why it is not one."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"the body is not valid JSON: {exc}") from None
    except RecursionError:  # arrays or objects nested deeper than the parser goes
        raise ValueError("the body is not valid JSON: it is nested too deeply") from None
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    return body


class BodyTooLarge(Exception):
    """A chunked body grew past the limit while being read."""


async def _read_body(receive: Receive, limit: int) -> bytes:
    parts = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge()
        parts.append(chunk)
        if not message.get("more_body"):
            break
    return b"".join(parts)


async def _read_upload(receive: Receive, limit: int) -> bytearray:
    """A body read into one growing buffer (never a list of chunks joined after: the upload
    exists once); BodyTooLarge past `limit`, ClientGone when the client leaves mid-way."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        body += message.get("body", b"")
        if len(body) > limit:
            raise BodyTooLarge()
        if not message.get("more_body"):
            return body


async def _send_answer(send: Send, receive: Receive, answer: Answer, request_id: str) -> None:
    headers = [(b"content-type", answer.headers["content-type"].encode("latin-1")),
               (b"x-request-id", request_id.encode("latin-1"))]
    if answer.chunks is None:
        body = answer.body or b""
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await _relay_chunks(send, receive, answer.chunks)


async def _relay_chunks(send: Send, receive: Receive, chunks: AsyncGenerator[bytes, None]
                        ) -> None:
    """Sends the pod's SSE chunks on as they come. The chunk ending in `data: [DONE]` ends
    the client's response at once (no separate empty write after it); what the pod still
    sends after it, normally nothing but the end of its chunked body, is read and dropped so
    its connection stays reusable."""
    # A client that goes away ends the relay at the next chunk; closing the stream closes the
    # pod's connection, and the engine aborts the request instead of generating for no one.
    # Watching costs a task, so it starts once the stream has lasted WATCH_DISCONNECT_AFTER_S:
    # a client that leaves sooner costs the engine at most that much generation.
    loop = asyncio.get_running_loop()
    watch_from = loop.time() + WATCH_DISCONNECT_AFTER_S
    gone: asyncio.Future[None] | None = None
    is_complete = False
    try:
        async with contextlib.aclosing(chunks) as stream:
            async for chunk in stream:
                if is_complete:
                    continue
                if gone is None:
                    if loop.time() >= watch_from:
                        gone = asyncio.ensure_future(_wait_disconnect(receive))
                elif gone.done():
                    return
                is_complete = chunk.endswith(SSE_DONE)
                await send({"type": "http.response.body", "body": chunk,
                            "more_body": not is_complete})
        if not is_complete:
            await send({"type": "http.response.body", "body": b""})
    finally:
        if gone is not None:
            gone.cancel()


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_error(send: Send, status: int, message: str, code: str | None, request_id: str,
                      extra_headers: list[tuple[bytes, bytes]] | None = None,
                      param: str | None = None) -> None:
    body = json.dumps(error_body(status, message, param, code)).encode()
    await _send_json(send, status, body, request_id, extra_headers)


async def _send_json(send: Send, status: int, body: bytes, request_id: str,
                     extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"x-request-id", request_id.encode("latin-1")), *(extra_headers or ())]})
    await send({"type": "http.response.body", "body": body})


def _limited(receive: Receive, limit: int) -> Receive:
    seen = 0

    async def receive_limited() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge()
        return message

    return receive_limited


def _limit_flag(path: str, is_larger: bool) -> str:
    """The flag that sets the body limit a path's body went over."""
    if path == AUDIO_PATH:
        return "--max-audio-body-bytes"
    if is_larger:
        return "--max-embeds-body-bytes for a body with prompt_embeds"
    return "--max-body-bytes"


def _too_large(limit: int, flag: str = "--max-body-bytes") -> JSONResponse:
    return error_json(413, f"the request body is larger than {limit} bytes ({flag})",
                      code="request_too_large")


def build_app(router: Router) -> Gate:
    """The gate in front of FastAPI, not inside its middleware stack: generation requests
    never pass through Starlette's error and body-limit layers (each costs a send wrapper
    and a coroutine per request); the rest reaches FastAPI's routes as before."""
    app = FastAPI(title="kvferry router", docs_url=None, redoc_url=None)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    _add_passthrough_routes(app, router)
    _add_probe_routes(app, router)
    return Gate(app, router)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    """Unknown paths (404) and methods (405) in OpenAI's error shape, as the engine answers."""
    assert isinstance(exc, StarletteHTTPException)
    response = error_json(exc.status_code, http_error_message(exc.status_code, exc.detail))
    response.headers.update(exc.headers or {})
    return response


def _add_passthrough_routes(app: FastAPI, router: Router) -> None:
    """Endpoints any pod answers alike: relayed to a live pod of the decode pool."""

    async def relay(request: Request, method: str, path: str) -> Response:
        pods = router.pods.pool("decode") or router.pods.pool("prefill")
        if not pods:
            return error_json(503, "no pod can serve this request: no live pod",
                              code="service_unavailable")
        pod = min(pods, key=lambda p: p.num_routed)
        try:
            raw = await request.body()
            async with router.client.request(
                    method, pod.url + path, data=raw or None,
                    headers={"content-type": "application/json"},
                    timeout=aiohttp.ClientTimeout(PASSTHROUGH_TIMEOUT_S)) as response:
                content = await response.read()
        except BodyTooLarge:
            return _too_large(router.settings.max_body_bytes)
        except TRANSPORT_ERRORS as exc:
            if isinstance(exc, aiohttp.ClientConnectorError):  # nothing serves there
                router.pods.drop_unreachable(pod)
            else:
                router.pods.mark_failed(pod)
            return error_json(502, f"pod {pod.name} failed: {type(exc).__name__}",
                              code="bad_gateway")
        return Response(content, status_code=response.status,
                        media_type=response.headers.get("content-type"))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await relay(request, "GET", "/v1/models")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await relay(request, "POST", "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await relay(request, "POST", "/detokenize")


def _add_probe_routes(app: FastAPI, router: Router) -> None:
    @app.get("/health")
    async def health() -> Response:
        pools = router.pods.pools()
        body = {"pools": pools, "redis": router.pods.is_connected}
        status = 200 if pools.get("decode") else 503
        return JSONResponse(body, status_code=status)

    @app.get("/ping")
    async def ping() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": kvferry.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)


class CleanExitServer(uvicorn.Server):
    """uvicorn that returns after SIGTERM/SIGINT instead of raising the signal again, so
    the caller's cleanup (leaving the registry, closing clients) runs and the exit is 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()


class RouterServer(CleanExitServer):
    """The router's server: while it drains it says, at the signal and then every second,
    what is still in flight."""

    def __init__(self, config: uvicorn.Config, gate: Gate, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.gate = gate
        self.drain_timeout_s = drain_timeout_s
        self._drain_log: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit and not self.gate.in_flight:
            logger.info("%s: no request in flight; stopping", signal.Signals(sig).name)
        elif not self.should_exit:
            logger.info("%s: draining %s in flight for up to %g s; new connections are "
                        "refused", signal.Signals(sig).name, self.gate.describe_in_flight(),
                        self.drain_timeout_s)
            # A signal handler interrupts the loop anywhere: the task starts from the loop.
            with contextlib.suppress(RuntimeError):  # no loop runs in this thread
                asyncio.get_running_loop().call_soon_threadsafe(self._start_drain_log)
        super().handle_exit(sig, frame)

    def _start_drain_log(self) -> None:
        self._drain_log = asyncio.ensure_future(self._log_drain())

    async def _log_drain(self) -> None:
        deadline = asyncio.get_running_loop().time() + self.drain_timeout_s
        while True:
            await asyncio.sleep(1.0)
            if not self.gate.in_flight:
                logger.info("drained: no request in flight")
                return
            left = deadline - asyncio.get_running_loop().time()
            logger.info("draining: %s in flight, %.0f s left", self.gate.describe_in_flight(),
                        max(left, 0.0))

    def stop_drain_log(self) -> None:
        if self._drain_log is not None:
            self._drain_log.cancel()


def serve(settings: RouterSettings, tokenizer: Tokenizer | None = None) -> int:
    """Runs the router until SIGTERM/SIGINT; returns the exit code."""
    try:
        import uvloop
    except ImportError:  # uvloop is optional (not on every platform)
        return asyncio.run(_serve(settings, tokenizer))
    # uvicorn picks uvloop only in its own run(); serving from our loop needs it set here.
    return uvloop.run(_serve(settings, tokenizer))


async def _serve(settings: RouterSettings, tokenizer: Tokenizer | None) -> int:
    router = Router(settings, tokenizer)
    await router.start()
    gate = build_app(router)
    config = uvicorn.Config(gate, host=settings.host, port=settings.port,
                            log_level=settings.uvicorn_log_level, access_log=False,
                            lifespan="off",
                            # SIGTERM stops new connections; requests in flight may finish.
                            timeout_graceful_shutdown=settings.drain_timeout_s,  # type: ignore[arg-type]
                            # Nothing here reads the client's address, and clients need
                            # no `server` header: both would cost work on every request.
                            proxy_headers=False, server_header=False,
                            **uvicorn_options(settings.http_limits))
    server = RouterServer(config, gate, settings.drain_timeout_s)
    logger.info("routing service %s on http://%s:%d (policies: %s)", settings.service,
                settings.host, settings.port,
                ", ".join(f"{k}={v}" for k, v in settings.policies.items()))
    try:
        await server.serve()
    finally:
        server.stop_drain_log()
        await router.stop()
    return 0 if server.started else 1
