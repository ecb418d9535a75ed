"""A stand-in engine pod that answers at once, for measuring and testing the router alone.

`python -m kvferry_testing.fake_engine --port P [--role R --redis URL --service S]` serves
/v1/completions and /v1/chat/completions (streamed or not) with a fixed three-token answer,
registers in the pod registry like `kvferry serve` (its record and KV events signed with
$KVFERRY_KV_TRANSFER_KEY when set), and plays a prefill pod's part: given
`kv_transfer_params: {"do_remote_decode": true}` it returns transfer params naming itself.
`GET /fake/requests` lists the bodies it received; `POST /fake/behaviour` with
`{"behaviour": "ok" | "refuse" | "invalid" | "cut" | "drop" | "hang" | "hold"}` makes it answer
503, answer 400 as an engine refusing a bad request, cut streams after one chunk or before the
first, never answer, or hold requests until the behaviour changes and then answer them. `POST /fake/cache` with `{"token_ids": [...]}` has it
publish KV events as an engine whose prefix cache now holds that prompt's full blocks
(`"cache_salt"`, hex, is the prompt's extra key: the hash of a prompt of embeddings);
`GET /fake/tokenize_calls` counts the /tokenize requests it answered, and
`GET /fake/connections` the client connections its generation requests came on.
`POST /fake/cache` with `{"cross_hashes": [hex, ...]}` publishes them as cross-attention
blocks the pod now holds.

`--encoder-input tokens|audio` (with `--max-encoder-len`) registers it as a pod of an
encoder-decoder model. It then takes /v1/audio/transcriptions forms too (parsed by
Starlette, python-multipart: not the router's parser), recording each as
`{"form": {field: value}, "file_sha256": hex, "file_size": n}`; and as `--role encoder` it
plays the encoder pod's part of the contract (notes in router/encode.py): given transfer
params asking for a hold, it answers the endpoint's empty result plus params naming
cross-attention blocks and the encoder input's key (a text's ids being its words' lengths,
as its /tokenize gives them; a file's key the sha256 of its bytes); as `--role prefill`,
given a transcription asking for a hold, it answers params naming both block groups.
`POST /fake/loop` with `{"work_ms": W}` has every later generation request hold the event
loop for W ms of Python work first (a pod whose loop parses, tokenizes and detokenizes),
and with `{"block_s": S}` blocks the loop for S seconds at once, answering afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import time
from typing import Any

import uvicorn
from kvferry.engine.core.messages import SchedulerStats
from kvferry.engine.server.registry import PodRegistrar
from starlette.types import Receive, Scope, Send

from kvferry.protocol.block_hash import (
    encoder_input_key,
    encoder_token_payload,
    hash_request_blocks,
)

TOKENS = (" a", " b", " c")
# Its 400, in the engine's shape, for the "invalid" behaviour.
INVALID_ANSWER = {"error": {"message": "max_tokens: must be at most 16", "type":
                            "invalid_request_error", "param": "max_tokens", "code": None}}
# Tokens per KV block it registers with (the router hashes prompts by it).
BLOCK_SIZE = 16
AUDIO_PATH = "/v1/audio/transcriptions"


class FakeEngine:
    """A raw ASGI app (no framework) so its own cost stays far below the router's."""

    def __init__(self, name: str, role: str, encoder_input: str = "") -> None:
        self.name = name
        self.role = role
        # "tokens" | "audio" for a pod of an encoder-decoder model, "" otherwise.
        self.encoder_input = encoder_input
        self.behaviour = "ok"
        self._behaviour_changed = asyncio.Event()
        self.received: list[dict[str, Any]] = []
        self.num_tokenize_calls = 0
        # Seconds of Python work each generation request does on the event loop.
        self.loop_work_s = 0.0
        # The /tokenize queries the pod was sent, in order.
        self.tokenize_bodies: list[dict[str, Any]] = []
        # (host, port) of the connections generation requests came on.
        self.connections: set[tuple[str, int]] = set()
        # Set when it registers in Redis: its KV events go out through it.
        self.registrar: PodRegistrar | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"].startswith("/v1/"):
            self.connections.add(tuple(scope["client"]))  # type: ignore[arg-type]
        if scope["path"] == AUDIO_PATH:
            await self._transcribe(scope, body, send)
            return
        await self._route(scope["method"], scope["path"], body, send)

    async def _route(self, method: str, path: str, body: bytes, send: Send) -> None:
        if path in ("/health", "/ping"):
            await _send(send, 200, b"", "text/plain")
        elif path == "/fake/requests":
            await _send(send, 200, json.dumps(self.received).encode())
        elif path == "/fake/behaviour":
            self.behaviour = json.loads(body)["behaviour"]
            self._behaviour_changed.set()
            self._behaviour_changed = asyncio.Event()
            await _send(send, 200, b"{}")
        elif path == "/fake/cache":
            request = json.loads(body)
            if "cross_hashes" in request:
                await _send(send, *self._cache_cross([bytes.fromhex(h)
                                                      for h in request["cross_hashes"]]))
                return
            salt = request.get("cache_salt")
            await _send(send, *self._cache(request["token_ids"],
                                           bytes.fromhex(salt) if salt else None))
        elif path == "/fake/loop":
            settings = json.loads(body)
            self.loop_work_s = settings.get("work_ms", self.loop_work_s * 1000) / 1000
            _hold_loop(settings.get("block_s", 0.0))
            await _send(send, 200, b"{}")
        elif path == "/fake/connections":
            await _send(send, 200, json.dumps(len(self.connections)).encode())
        elif path == "/fake/tokenize_calls":
            await _send(send, 200, json.dumps(self.num_tokenize_calls).encode())
        elif path == "/fake/tokenize_bodies":
            await _send(send, 200, json.dumps(self.tokenize_bodies).encode())
        elif path == "/tokenize":
            self.num_tokenize_calls += 1
            query = json.loads(body)
            self.tokenize_bodies.append(query)
            # One token per word of the prompt, or of the messages' text contents.
            text = query.get("prompt") or " ".join(
                str(m.get("content") or "") for m in query.get("messages") or ())
            tokens = [len(word) for word in text.split()]
            await _send(send, 200, json.dumps({"tokens": tokens, "count": len(tokens)}).encode())
        elif path in ("/v1/completions", "/v1/chat/completions"):
            await self._generate(path, json.loads(body), send)
        else:
            await _send(send, 404, b'{"error": {"message": "not found"}}')

    def _cache(self, token_ids: list[int], cache_salt: bytes | None) -> tuple[int, bytes]:
        """Publishes `stored` KV events for the prompt's full blocks, hashed as the engine's
        block pool hashes them (with the prompt's extra key, if any), through the same
        registrar path an engine step takes."""
        if self.registrar is None:
            return 409, b'{"error": {"message": "not registered in Redis"}}'
        hashes = hash_request_blocks(token_ids, BLOCK_SIZE, [], cache_salt)
        self.registrar.record_stats(SchedulerStats(stored_block_hashes=hashes), None)
        return 200, json.dumps({"num_blocks": len(hashes)}).encode()

    def _cache_cross(self, hashes: list[bytes]) -> tuple[int, bytes]:
        """Publishes `stored` KV events of cross-attention blocks."""
        if self.registrar is None:
            return 409, b'{"error": {"message": "not registered in Redis"}}'
        self.registrar.record_stats(SchedulerStats(stored_cross_hashes=hashes), None)
        return 200, json.dumps({"num_blocks": len(hashes)}).encode()

    async def _transcribe(self, scope: Scope, body: bytes, send: Send) -> None:
        """A transcription form, read by Starlette as the engine's route reads it."""
        from starlette.requests import Request

        if not _header(scope, b"content-type").startswith("multipart/form-data"):
            await _send(send, 400, b'{"error": {"message": "not a multipart form"}}')
            return

        async def replay() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            form = await Request(scope, replay).form()
        except Exception as exc:  # noqa: BLE001 (Starlette raises several kinds)
            await _send(send, 400, json.dumps({"error": {"message": f"bad form: {exc}"}}
                                              ).encode())
            return
        fields: dict[str, Any] = {}
        file_data = b""
        for name, value in form.multi_items():
            if isinstance(value, str):
                fields[name] = value
            else:
                file_data = await value.read()
        seen = {"form": fields, "file_sha256": hashlib.sha256(file_data).hexdigest(),
                "file_size": len(file_data), "content_type": _header(scope, b"content-type")}
        params = json.loads(fields.get("kv_transfer_params") or "{}")
        if await self._misbehave(seen, send):
            return
        if params.get("do_remote_decode") and self.role in ("encoder", "prefill"):
            key = encoder_input_key("audio-file", hashlib.sha256(file_data).digest())
            held = self._encoder_params(key, 1500)
            if self.role == "prefill":
                # A prefill pod's hold of a long decoder prompt: its blocks and the cross
                # blocks (pulled from the encoder pod the params name, or its own).
                held = {**held, "remote_block_ids": [[1, 2, 3], held["remote_block_ids"][1]],
                        "remote_request_id": "fake-prefill", "kvferry_num_tokens": 40}
            answer = {"text": "", "kv_transfer_params": held}
            await _send(send, 200, json.dumps(answer).encode())
            return
        if fields.get("response_format") == "text":
            await _send(send, 200, "".join(TOKENS).strip().encode(), "text/plain")
            return
        await _send(send, 200, json.dumps({"text": "".join(TOKENS).strip()}).encode())

    async def _misbehave(self, body: dict[str, Any], send: Send) -> bool:
        """Answers as the behaviour says, when it says otherwise than "ok" (True then)."""
        if self.behaviour == "refuse":
            await _send(send, 503, b'{"error": {"message": "refusing"}}')
            return True
        if self.behaviour == "invalid":
            self.received.append(body)
            await _send(send, 400, json.dumps(INVALID_ANSWER).encode())
            return True
        if self.behaviour == "busy":
            await _send(send, 429, b'{"error": {"message": "too many requests"}}')
            return True
        if self.behaviour == "garbled":
            self.received.append(body)
            await _send(send, 200, b'{"text": ""}')
            return True
        self.received.append(body)
        return False

    def _encoder_params(self, key: bytes, num_positions: int) -> dict[str, Any]:
        """What an encoder pod hands the decode pod: its cross blocks, held for it."""
        num_blocks = -(-num_positions // BLOCK_SIZE)
        return {
            "do_remote_prefill": True, "remote_engine_id": self.name,
            "remote_host": "127.0.0.1", "remote_port": 1,
            "remote_block_ids": [[], list(range(1, num_blocks + 1))],
            "remote_request_id": "fake-encode", "kvferry_agent_name": self.name,
            "kvferry_num_tokens": 0, "kvferry_lease_s": 30.0,
            "kvferry_encoder_hash": key.hex(), "kvferry_num_encoder_tokens": num_positions,
            "kvferry_expires_at": time.time() + 30, "kvferry_mac": "fake",
            "kvferry_protocol_version": 1}

    async def _generate(self, path: str, body: dict[str, Any], send: Send) -> None:
        _hold_loop(self.loop_work_s)
        if self.behaviour == "hold":
            # A slow pod: the requests pile up, then all go on at once.
            self.received.append(body)
            await self._behaviour_changed.wait()
            await self._answer(path, body, send)
            return
        if self.behaviour == "refuse":
            await _send(send, 503, b'{"error": {"message": "refusing"}}')
            return
        if self.behaviour == "invalid":
            self.received.append(body)
            await _send(send, 400, json.dumps(INVALID_ANSWER).encode())
            return
        if self.behaviour == "hang":
            # A stuck pod: the router's timeout must end the wait; a new behaviour ends it here.
            await self._behaviour_changed.wait()
            await _send(send, 503, b'{"error": {"message": "was stuck"}}')
            return
        if self.encoder_input and self.behaviour in ("busy", "garbled"):
            await self._misbehave(body, send)
            return
        self.received.append(body)
        params = body.get("kv_transfer_params") or {}
        if self.role == "encoder" and params.get("do_remote_decode"):
            await self._encode(body, send)
            return
        await self._answer(path, body, send)

    async def _encode(self, body: dict[str, Any], send: Send) -> None:
        """An encoder pod's answer to a completion: one empty choice and the params."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        ids = prompt if isinstance(prompt, list) else [len(w) for w in str(prompt).split()]
        key = encoder_input_key("tokens", encoder_token_payload(ids))
        answer = {"id": "cmpl-fake", "object": "text_completion", "created": 0,
                  "model": "fake", "choices": [{"index": 0, "text": "",
                                                "finish_reason": "stop"}],
                  "usage": {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1},
                  "kv_transfer_params": self._encoder_params(key, len(ids))}
        await _send(send, 200, json.dumps(answer).encode())

    async def _answer(self, path: str, body: dict[str, Any], send: Send) -> None:
        chat = path.endswith("chat/completions")
        if body.get("stream"):
            await self._stream(chat, send)
            return
        await _send(send, 200, json.dumps(self._whole(chat, body)).encode())

    def _whole(self, chat: bool, body: dict[str, Any]) -> dict[str, Any]:
        remote = (body.get("kv_transfer_params") or {}).get("do_remote_decode")
        text = "".join(TOKENS[:1] if remote else TOKENS)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        answer: dict[str, Any] = {
            "id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion",
            "created": 0, "model": "fake", "choices": [choice],
            "usage": {"prompt_tokens": 4, "completion_tokens": len(text.split()),
                      "total_tokens": 4 + len(text.split())},
        }
        if remote:
            answer["kv_transfer_params"] = {
                "do_remote_prefill": True, "remote_engine_id": self.name,
                "remote_block_ids": [1, 2], "remote_request_id": "fake",
                "remote_host": "127.0.0.1", "remote_port": 1}
        return answer

    async def _stream(self, chat: bool, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i, token in enumerate(TOKENS):
            if (self.behaviour, i) in (("cut", 1), ("drop", 0)):
                raise ConnectionError("fake engine cut the stream")  # uvicorn drops the socket
            delta = {"delta": {"content": token}} if chat else {"text": token}
            chunk = {"id": "cmpl-fake", "choices": [{"index": 0, **delta}]}
            await send({"type": "http.response.body", "more_body": True,
                        "body": b"data: " + json.dumps(chunk).encode() + b"\n\n"})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return ""


def _hold_loop(seconds: float) -> None:
    """Keeps the event loop busy with Python work (not a sleep: the thread keeps the GIL
    but for the interpreter's switch interval, as real request handling does)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def _send(send: Send, status: int, body: bytes, content_type: str = "application/json"
                ) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _main(args: argparse.Namespace) -> None:
    app = FakeEngine(args.name or os.environ.get("KVFERRY_POD_NAME") or f"fake-{args.port}",
                     args.role, args.encoder_input)
    registrar = None
    if args.redis:
        from kvferry.engine.server.registry import registration_settings

        from kvferry.kvtransfer.auth import key_from_environment

        settings = registration_settings(args.redis, args.service, args.role, args.host,
                                         args.port, None, key_from_environment(os.environ))
        registrar = PodRegistrar(settings, "fake", block_size=BLOCK_SIZE,
                                 encoder_input=args.encoder_input,
                                 max_encoder_len=args.max_encoder_len if args.encoder_input
                                 else 0)
        registrar.start()
        app.registrar = registrar
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            access_log=False, lifespan="off")
    try:
        from kvferry.router.app import CleanExitServer

        await CleanExitServer(config).serve()
    finally:
        if registrar is not None:
            await registrar.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--role", default="both")
    parser.add_argument("--name", default=None)
    parser.add_argument("--redis", default=None)
    parser.add_argument("--service", default="default")
    parser.add_argument("--encoder-input", default="", choices=["", "tokens", "audio"])
    parser.add_argument("--max-encoder-len", type=int, default=1500)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
