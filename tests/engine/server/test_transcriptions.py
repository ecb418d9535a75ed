"""/v1/audio/transcriptions on a live `kvferry serve` whose model takes no audio (the tiny
Llama): what is wrong with a request's shape is a 400 naming it (no file, no model, a JSON
body, a form that does not parse), a body over `--max-audio-body-bytes` a 413 before it is
read, and a well-formed request a 400 saying the model takes no audio; each in OpenAI's
error body, through the official client where it can send the request, and the server keeps
serving. (The refusals that need a Whisper model are in test_transcriber.py.)"""

from __future__ import annotations

import io
import json
import socket
import wave
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from kvferry_testing.serve_helpers import ServerProcess

URL = "/v1/audio/transcriptions"
# The general body limit, and the larger one of a transcription's form.
BODY_LIMIT = 65536
AUDIO_LIMIT = 262144


@pytest.fixture(scope="module")
def server(server_factory: Callable[..., ServerProcess], tiny_model: Path) -> ServerProcess:
    return server_factory(tiny_model, "--served-model-name", "tiny",
                          "--max-body-bytes", str(BODY_LIMIT),
                          "--max-audio-body-bytes", str(AUDIO_LIMIT))


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=60)


def wav(seconds: float, rate: int = 16000) -> bytes:
    t = np.arange(round(seconds * rate)) / rate
    ints = np.round(0.5 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(ints.tobytes())
    return out.getvalue()


def post_form(server: ServerProcess, data: dict[str, str],
              files: dict[str, tuple[str, bytes]] | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}{URL}", data=data, files=files, timeout=60)


def assert_error(response: httpx.Response, status: int, param: str | None,
                 message: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert message in error["message"], error["message"]


def assert_still_serving(server: ServerProcess) -> None:
    out = httpx.post(f"{server.url}/v1/completions", timeout=60,
                     json={"model": "tiny", "prompt": "w5 w6", "max_tokens": 2})
    assert out.status_code == 200, out.text
    assert out.json()["usage"]["completion_tokens"] == 2


def test_a_model_that_takes_no_audio_refuses_a_transcription(client: openai.OpenAI,
                                                             server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.transcriptions.create(model="tiny", file=("speech.wav", wav(1.0)))
    assert caught.value.status_code == 400
    assert caught.value.body == {
        "message": "this model does not take audio: /v1/audio/transcriptions needs a Whisper "
                   "model, and this server serves LlamaForCausalLM",
        "type": "invalid_request_error", "param": "model", "code": None}
    assert_still_serving(server)


def test_another_models_name_is_a_404(client: openai.OpenAI, server: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.audio.transcriptions.create(model="whisper-1", file=("a.wav", wav(0.1)))
    assert caught.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert_still_serving(server)


def test_a_missing_file_or_model_field_is_a_400_naming_it(server: ServerProcess) -> None:
    assert_error(post_form(server, {"model": "tiny"}, {"other": ("a.wav", wav(0.1))}),
                 400, "file", "file: Field required")
    assert_error(post_form(server, {"language": "en"}, {"file": ("a.wav", wav(0.1))}),
                 400, "model", "model: Field required")
    # A text field where the file should be.
    response = httpx.post(f"{server.url}{URL}", timeout=60,
                          files={"model": (None, "tiny"), "file": (None, "not a file")})
    assert_error(response, 400, "file", "file: ")
    assert_still_serving(server)


def test_a_field_of_the_wrong_type_is_a_400_naming_it(server: ServerProcess) -> None:
    response = post_form(server, {"model": "tiny", "temperature": "warm"},
                         {"file": ("a.wav", wav(0.1))})
    assert_error(response, 400, "temperature", "temperature: Input should be a valid number")
    assert_still_serving(server)


@pytest.mark.parametrize(("content_type", "body"), [
    ("application/json", json.dumps({"model": "tiny", "file": "UklGRg=="}).encode()),
    ("application/x-www-form-urlencoded", b"model=tiny&file=abc"),
])
def test_a_body_that_is_not_a_multipart_form_is_a_400_saying_so(
        server: ServerProcess, content_type: str, body: bytes) -> None:
    response = httpx.post(f"{server.url}{URL}", content=body, timeout=60,
                          headers={"Content-Type": content_type})
    assert_error(response, 400, None, "/v1/audio/transcriptions takes a multipart/form-data "
                                      f"body (the file and the fields as form parts), got "
                                      f"content type {content_type!r}")
    assert_still_serving(server)


def test_a_form_that_does_not_parse_is_a_400(server: ServerProcess) -> None:
    response = httpx.post(f"{server.url}{URL}", content=b"--xyz\r\ngarbage", timeout=60,
                          headers={"Content-Type": "multipart/form-data; boundary=abc"})
    assert response.status_code == 400, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert_still_serving(server)


def test_the_audio_limit_replaces_the_general_one_for_a_transcription(
        server: ServerProcess) -> None:
    # Over --max-body-bytes, under --max-audio-body-bytes: it reaches the route.
    bigger_than_json = wav(4.0)
    assert BODY_LIMIT < len(bigger_than_json) < AUDIO_LIMIT
    assert_error(post_form(server, {"model": "tiny"}, {"file": ("a.wav", bigger_than_json)}),
                 400, "model", "this model does not take audio")
    assert_still_serving(server)


def test_an_upload_over_the_audio_limit_is_a_413_through_the_client(
        client: openai.OpenAI, server: ServerProcess) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client.audio.transcriptions.create(model="tiny", file=("long.wav", wav(9.0)))
    assert caught.value.status_code == 413
    assert caught.value.body == {
        "message": f"the request body is larger than the limit of {AUDIO_LIMIT} bytes "
                   "(--max-audio-body-bytes)",
        "type": "invalid_request_error", "param": None, "code": "request_too_large"}
    assert_still_serving(server)


def raw_exchange(server: ServerProcess, head: bytes, parts: list[bytes]) -> tuple[int, Any]:
    """Sends a request as raw bytes, part by part (stopping when the server has answered
    and closed), and reads the answer: (status, JSON body)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as conn:
        conn.sendall(head)
        for part in parts:
            try:
                conn.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    header, _, rest = data.partition(b"\r\n\r\n")
    return int(header.split(b" ")[1]), json.loads(rest)


def test_a_chunked_upload_is_cut_off_once_it_grows_past_the_limit(server: ServerProcess) -> None:
    head = (f"POST {URL} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            "Content-Type: multipart/form-data; boundary=abc\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    # Just past the limit: the server answers once it has read that far, and closing with
    # much of a body unread could reset the connection before the answer is read.
    payload = b"x" * (AUDIO_LIMIT + 100)
    pieces = [payload[i:i + 8192] for i in range(0, len(payload), 8192)]
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces]
    status, body = raw_exchange(server, head, [*chunks, b"0\r\n\r\n"])
    assert status == 413
    assert body["error"]["code"] == "request_too_large"
    assert "(--max-audio-body-bytes)" in body["error"]["message"]
    assert_still_serving(server)
