"""A pod refuses what it cannot serve before spending time on it: a body over
`--max-body-bytes` is a 413 before it is read (by its Content-Length, or as soon as a
chunked body grows past the limit), a text prompt too long to fit the model is a 400
decided from its length alone, before tokenizing it, and `stop` strings past
`--max-stop-strings` or `--max-stop-bytes` are a 400. The server keeps serving."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import httpx
import pytest

from kvferry_testing.serve_helpers import MAX_MODEL_LEN, ServerProcess

BODY_LIMIT = 65536
MAX_STOP_STRINGS = 8
MAX_STOP_BYTES = 64


@pytest.fixture(scope="module")
def demo(server_factory: Callable[..., ServerProcess]) -> ServerProcess:
    """The demo model (byte-level BPE, so a text's length bounds its tokens), small limit."""
    return server_factory("demo", "--max-body-bytes", str(BODY_LIMIT),
                          "--max-stop-strings", str(MAX_STOP_STRINGS),
                          "--max-stop-bytes", str(MAX_STOP_BYTES))


def raw_exchange(server: ServerProcess, head: bytes, body_parts: Iterable[bytes] = ()
                 ) -> tuple[int, dict[str, Any]]:
    """Sends a request as raw bytes and reads the answer: (status, JSON body)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as conn:
        conn.sendall(head)
        for part in body_parts:
            conn.sendall(part)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data:
                header, _, rest = data.partition(b"\r\n\r\n")
                length = [int(line.split(b":")[1]) for line in header.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")]
                if length and len(rest) >= length[0]:
                    break
    header, _, rest = data.partition(b"\r\n\r\n")
    return int(header.split(b" ")[1]), json.loads(rest)


def request_head(path: str, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
             "Connection: close", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunked(body: bytes, size: int = 8192) -> Iterator[bytes]:
    for start in range(0, len(body), size):
        piece = body[start:start + size]
        yield b"%x\r\n%s\r\n" % (len(piece), piece)
    yield b"0\r\n\r\n"


def assert_too_large(status: int, body: dict[str, Any]) -> None:
    assert status == 413, body
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "request_too_large"
    assert f"larger than the limit of {BODY_LIMIT} bytes" in body["error"]["message"]


def assert_still_serving(server: ServerProcess) -> None:
    assert httpx.get(f"{server.url}/ping", timeout=60).status_code == 200
    out = httpx.post(f"{server.url}/v1/completions", timeout=60,
                     json={"model": "demo", "prompt": "Hello", "max_tokens": 2})
    assert out.status_code == 200, out.text


def test_a_declared_length_over_the_limit_is_a_413_before_the_body_is_sent(
        demo: ServerProcess) -> None:
    # No body byte is ever sent: the answer can only come from the Content-Length.
    for length in (BODY_LIMIT + 1, 99999999999):
        status, body = raw_exchange(demo, request_head("/v1/completions",
                                                       f"Content-Length: {length}"))
        assert_too_large(status, body)
    assert_still_serving(demo)


def test_a_chunked_body_growing_past_the_limit_is_a_413(demo: ServerProcess) -> None:
    text = "x" * (BODY_LIMIT + 100)
    raw = json.dumps({"model": "demo", "prompt": text, "max_tokens": 2}).encode()
    status, body = raw_exchange(demo, request_head("/v1/completions",
                                                   "Transfer-Encoding: chunked"), chunked(raw))
    assert_too_large(status, body)
    assert_still_serving(demo)


def test_a_chunked_body_within_the_limit_is_served(demo: ServerProcess) -> None:
    raw = json.dumps({"model": "demo", "prompt": "Hello there", "max_tokens": 2}).encode()
    status, body = raw_exchange(demo, request_head("/v1/completions",
                                                   "Transfer-Encoding: chunked"),
                                chunked(raw, size=5))
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 2


def test_a_prompt_too_long_by_its_length_alone_is_refused_untokenized(
        demo: ServerProcess, longest: int) -> None:
    # Within the body limit, but more characters than max_model_len tokens could cover.
    text = "Hello " * ((MAX_MODEL_LEN * longest) // 6 + 10)
    assert len(json.dumps(text)) < BODY_LIMIT
    at_least = -(-len(text) // longest)
    for path, body, param in (
            ("/v1/completions", {"prompt": text}, "prompt"),
            ("/v1/completions", {"prompt": text, "add_special_tokens": False}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]},
             "messages")):
        out = httpx.post(f"{demo.url}{path}", json={"model": "demo", **body}, timeout=60)
        assert out.status_code == 400, out.text
        error = out.json()["error"]
        assert error["param"] == param
        # "at least": the count comes from the length; a tokenized prompt has an exact count.
        # (A chat's rendered template adds its own characters to the message's.)
        match = re.match(r"the prompt has at least (\d+) tokens \((\d+) characters",
                         error["message"])
        assert match is not None, error
        assert int(match[1]) >= at_least and int(match[2]) >= len(text), error
        assert f"more than the maximum model length of {MAX_MODEL_LEN}" in error["message"]
    assert_still_serving(demo)


def test_a_long_prompt_that_may_fit_is_still_tokenized(demo: ServerProcess) -> None:
    # Few enough characters to fit: tokenized, and then its exact count decides.
    text = "Hello " * (MAX_MODEL_LEN + 10)
    out = httpx.post(f"{demo.url}/v1/completions", timeout=60,
                     json={"model": "demo", "prompt": text, "max_tokens": 2})
    assert out.status_code == 400, out.text
    message = out.json()["error"]["message"]
    assert "at least" not in message and "maximum model length" in message, message


@pytest.fixture(scope="module")
def longest(tmp_path_factory: pytest.TempPathFactory) -> int:
    """The most characters one demo token stands for: its longest vocabulary string."""
    from kvferry.engine.models.demo import create_demo_checkpoint

    model_dir = create_demo_checkpoint(tmp_path_factory.mktemp("demo"))
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    texts = [*spec["model"]["vocab"], *(t["content"] for t in spec["added_tokens"])]
    return max(len(t) for t in texts)


# (stop, the words of the 400; None: served). "é" is two bytes of UTF-8.
STOPS: list[tuple[str | list[str], list[str] | None]] = [
    (["w"] * MAX_STOP_STRINGS, None),
    (["w"] * (MAX_STOP_STRINGS + 1), [f"{MAX_STOP_STRINGS + 1} strings",
                                      f"limit of {MAX_STOP_STRINGS}", "--max-stop-strings"]),
    (["é" * (MAX_STOP_BYTES // 4)] * 2, None),
    (["é" * (MAX_STOP_BYTES // 4)] * 2 + ["x"], [f"{MAX_STOP_BYTES + 1} bytes",
                                                f"limit of {MAX_STOP_BYTES}",
                                                "--max-stop-bytes"]),
    ("é" * (MAX_STOP_BYTES // 2 + 1), [f"{MAX_STOP_BYTES + 2} bytes", "--max-stop-bytes"]),
]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("stop", "words"), STOPS, ids=[str(i) for i in range(len(STOPS))])
def test_stop_strings_past_the_limits_are_a_400(demo: ServerProcess, endpoint: str,
                                                 stop: str | list[str],
                                                 words: list[str] | None) -> None:
    prompt: dict[str, Any] = ({"prompt": "Hello"} if endpoint == "/v1/completions" else
                              {"messages": [{"role": "user", "content": "Hello"}]})
    out = httpx.post(f"{demo.url}{endpoint}", timeout=60,
                     json={"model": "demo", **prompt, "max_tokens": 2, "stop": stop})
    if words is None:
        assert out.status_code == 200, out.text
        return
    assert out.status_code == 400, out.text
    error = out.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "stop")
    for word in words:
        assert word in error["message"], error["message"]
    assert_still_serving(demo)
