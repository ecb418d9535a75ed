"""What one client can do to a real engine pod and the routers in front of it.

Two routers front the pod: one relays bodies as they come (one `both` pool, least-loaded),
the other reads them (prefix-aware, tokenizing text prompts itself with `--tokenizer demo`).
Bodies of the wrong JSON type, or with text that is not Unicode, get the same OpenAI 400
naming the same field from the pod and from both routers; a client that hangs up on a
non-streamed request stops its generation on the pod; connections that send nothing, or
send a request slowly, are closed within the servers' timeouts.
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvferry_testing.procs import Proc, fake_engine, free_port, router_process, wait_http
from kvferry_testing.serve_helpers import KV_CACHE_BYTES

SERVICE = "checks"
# Long enough that generating a whole sequence takes the demo model many seconds.
MAX_MODEL_LEN = 4096
# Short connection timeouts (seconds), so that tests can wait them out.
HEADER_TIMEOUT_S, BODY_TIMEOUT_S, KEEP_ALIVE_TIMEOUT_S = 1.0, 1.5, 1.0
LIMIT_FLAGS = ["--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S),
               "--keep-alive-timeout", str(KEEP_ALIVE_TIMEOUT_S)]
# A router that takes this many client connections at once.
MAX_CONNECTIONS = 8
FLAGS = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
         *LIMIT_FLAGS]


def engine_pod(tmp: Path, redis_url: str, name: str) -> Proc:
    port = free_port()
    proc = Proc([sys.executable, "-m", "kvferry.cli", "serve", "--model", "demo",
                 "--port", str(port), "--redis", redis_url, "--service", SERVICE, *FLAGS],
                tmp / f"{name}.log", env={"KVFERRY_POD_NAME": name})
    proc.port = port  # type: ignore[attr-defined]
    wait_http(f"http://127.0.0.1:{port}/health", proc, 240)
    return proc


def wait_decode_pool(router: Proc) -> None:
    wait_http(f"http://127.0.0.1:{router.port}/health", router, 20)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[dict[str, Proc]]:
    tmp = tmp_path_factory.mktemp("checks")
    procs: dict[str, Proc] = {}
    try:
        procs["pod"] = engine_pod(tmp, redis_url, "pod-0")
        # Each router writes router.log in its own folder.
        procs["relaying"] = router_process(tmp_path_factory.mktemp("relaying"), redis_url,
                                           SERVICE)
        procs["reading"] = router_process(tmp_path_factory.mktemp("reading"), redis_url,
                                          SERVICE, "--tokenizer", "demo",
                                          env={"KVFERRY_ROUTING_DECODE": "prefix-aware"})
        procs["limited"] = router_process(tmp_path_factory.mktemp("limited"), redis_url,
                                          SERVICE, *LIMIT_FLAGS,
                                          "--max-connections", str(MAX_CONNECTIONS))
        for name in ("relaying", "reading", "limited"):
            wait_decode_pool(procs[name])
        yield procs
    finally:
        for proc in procs.values():
            proc.stop(signal.SIGKILL if proc.proc.poll() is None else signal.SIGTERM)


def url(proc: Proc) -> str:
    return f"http://127.0.0.1:{proc.port}"  # type: ignore[attr-defined]


def post(proc: Proc, path: str, content: bytes) -> httpx.Response:
    return httpx.post(url(proc) + path, content=content, timeout=60,
                      headers={"Content-Type": "application/json"})


def answer_of(response: httpx.Response) -> tuple[int, str | None]:
    """(status, param) of an error answer; (200, None) of a success."""
    if response.status_code == 200:
        return 200, None
    assert response.headers["content-type"].startswith("application/json"), response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    return response.status_code, error["param"]


PROMPT = {"model": "demo", "prompt": "w5 w6", "max_tokens": 2}
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2}

# (endpoint, body, the param the 400 names)
WRONG_TYPES: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {**PROMPT, "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {**PROMPT, "max_tokens": 5.0}, "max_tokens"),
    ("/v1/completions", {**PROMPT, "prompt": [True]}, "prompt"),
    ("/v1/completions", {**PROMPT, "prompt": [[5, True]]}, "prompt"),
    ("/v1/completions", {**PROMPT, "prompt": [5, 6.0]}, "prompt"),
    ("/v1/completions", {**PROMPT, "stream": "yes"}, "stream"),
    ("/v1/completions", {**PROMPT, "stream": 1}, "stream"),
    ("/v1/completions", {**PROMPT, "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {**PROMPT, "top_p": True}, "top_p"),
    ("/v1/completions", {**PROMPT, "n": 1.5}, "n"),
    ("/v1/completions", {**PROMPT, "n": True}, "n"),
    ("/v1/completions", {**PROMPT, "logprobs": "3"}, "logprobs"),
    ("/v1/completions", {**PROMPT, "echo": 1}, "echo"),
    ("/v1/completions", {**PROMPT, "seed": "7"}, "seed"),
    ("/v1/completions", {**PROMPT, "stop_token_ids": [5, True]}, "stop_token_ids[1]"),
    ("/v1/completions", {**PROMPT, "stop": 5}, "stop"),
    ("/v1/completions", {**PROMPT, "ignore_eos": "true"}, "ignore_eos"),
    ("/v1/completions", {**PROMPT, "add_special_tokens": 0}, "add_special_tokens"),
    ("/v1/completions", {**PROMPT, "model": 5}, "model"),
    # Two wrong fields: both layers name the first the engine's model declares.
    ("/v1/completions", {**PROMPT, "max_tokens": "5", "n": "2"}, "n"),
    ("/v1/completions", {"max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": "2"}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": "5"}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "temperature": "0.5"}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "messages": "w5"}, "messages"),
]

# Right types at the edges: JSON integers where numbers belong, nulls where the API has them.
RIGHT_TYPES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {**PROMPT, "temperature": 1, "top_p": 1, "presence_penalty": 0}),
    ("/v1/completions", {**PROMPT, "prompt": [5, 6], "seed": None, "stop": None}),
    ("/v1/completions", {**PROMPT, "prompt": [[5], [6]], "stream": False}),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 1}),
]


@pytest.mark.parametrize(("endpoint", "body", "param"), WRONG_TYPES,
                         ids=[f"{'chat' if 'chat' in e else 'completions'}-{json.dumps(b)[-40:]}"
                              for e, b, _ in WRONG_TYPES])
def test_wrong_types_are_the_same_400_at_the_pod_and_both_routers(
        service: dict[str, Proc], endpoint: str, body: dict[str, Any], param: str) -> None:
    raw = json.dumps(body).encode()
    answers = {name: answer_of(post(service[name], endpoint, raw))
               for name in ("pod", "relaying", "reading")}
    assert answers == {"pod": (400, param), "relaying": (400, param), "reading": (400, param)}


@pytest.mark.parametrize(("endpoint", "body"), RIGHT_TYPES,
                         ids=[json.dumps(b)[-40:] for _, b in RIGHT_TYPES])
def test_right_types_are_served_by_the_pod_and_both_routers(
        service: dict[str, Proc], endpoint: str, body: dict[str, Any]) -> None:
    raw = json.dumps(body).encode()
    answers = {name: answer_of(post(service[name], endpoint, raw))
               for name in ("pod", "relaying", "reading")}
    assert answers == {"pod": (200, None), "relaying": (200, None), "reading": (200, None)}


# JSON that spells a lone UTF-16 surrogate: valid JSON, not valid Unicode.
LONE_SURROGATES = [
    ("/v1/completions", rb'{"model": "demo", "prompt": "w5 \ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", rb'{"model": "demo", "prompt": ["w5 \udfff"], "max_tokens": 2}',
     "prompt"),
    ("/v1/completions", rb'{"model": "demo", "prompt": "w5", "stop": ["\ud800"]}', "stop"),
    ("/v1/chat/completions",
     rb'{"model": "demo", "messages": [{"role": "user", "content": "\ud800"}]}', "messages"),
]


@pytest.mark.parametrize(("endpoint", "raw", "param"), LONE_SURROGATES,
                         ids=[r.decode()[-30:] for _, r, _ in LONE_SURROGATES])
def test_a_lone_surrogate_is_the_same_400_at_the_pod_and_both_routers(
        service: dict[str, Proc], endpoint: str, raw: bytes, param: str) -> None:
    answers = {name: answer_of(post(service[name], endpoint, raw))
               for name in ("pod", "relaying", "reading")}
    assert answers == {"pod": (400, param), "relaying": (400, param), "reading": (400, param)}
    message = post(service["reading"], endpoint, raw).json()["error"]["message"]
    assert "lone UTF-16 surrogate" in message
    # The router is still serving.
    ok = post(service["reading"], "/v1/completions", json.dumps(PROMPT).encode())
    assert ok.status_code == 200, ok.text


def running(pod: Proc) -> float:
    """The pod's vllm:num_requests_running."""
    for line in httpx.get(url(pod) + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            return float(line.rpartition(" ")[2])
    raise AssertionError("no vllm:num_requests_running on /metrics")


def wait_until(condition: Any, timeout_s: float) -> float:
    """Seconds until `condition()` held; AssertionError past `timeout_s`."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s"
        time.sleep(0.02)
    return time.monotonic() - started


# Long enough that generating it all takes the pod many seconds.
LONG_BODY = {"model": "demo", "prompt": "w5 w6", "max_tokens": MAX_MODEL_LEN - 16,
             "ignore_eos": True}


@pytest.mark.parametrize("via", ["pod", "relaying", "reading"])
def test_a_client_leaving_a_non_streamed_request_stops_it_on_the_pod(
        service: dict[str, Proc], via: str) -> None:
    pod = service["pod"]
    wait_until(lambda: running(pod) == 0, 30)
    hung_up = threading.Event()

    def leave_early() -> None:
        # The client gives up after 1.5 s: httpx closes the connection on the timeout.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url(service[via]) + "/v1/completions", json=LONG_BODY, timeout=1.5)
        hung_up.set()

    client = threading.Thread(target=leave_early)
    client.start()
    wait_until(lambda: running(pod) == 1, 5)
    assert hung_up.wait(5)
    stopped_in = wait_until(lambda: running(pod) == 0, 10)
    client.join()
    assert stopped_in < 2.0


def post_while_probing(target: Proc, path: str, body: bytes, probe: Proc, probe_path: str,
                       timeout_s: float = 30) -> tuple[httpx.Response, list[float]]:
    """POSTs `body` to `target` on a thread and, until it is answered, GETs `probe_path` on
    `probe` (each must be 200): the answer, and the seconds each probe took."""
    answers: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answers.append(post(target, path, body)))
    probe_s: list[float] = []
    sender.start()
    while sender.is_alive():
        started = time.monotonic()
        assert httpx.get(url(probe) + probe_path, timeout=timeout_s).status_code == 200
        probe_s.append(time.monotonic() - started)
        time.sleep(0.02)
    sender.join()
    return answers[0], probe_s


def test_a_huge_text_prompt_does_not_hold_the_router(service: dict[str, Proc]) -> None:
    router = service["reading"]  # it tokenizes text prompts itself (--tokenizer demo)
    prompt = "w5 " * 2_600_000  # 7.8 MB of text: seconds of tokenizing
    body = json.dumps({"model": "demo", "prompt": prompt, "max_tokens": 2}).encode()
    answer, health_s = post_while_probing(router, "/v1/completions", body, router, "/health")
    assert max(health_s) < 1.0, health_s
    # The pod's own refusal, from the length alone: the prompt cannot fit max_model_len.
    assert answer_of(answer) == (400, "prompt")
    assert "maximum model length" in answer.json()["error"]["message"]


def test_a_huge_text_tokenized_by_the_router_does_not_hold_it(
        tmp_path: Path, redis_url: str) -> None:
    """A pod that announces no length limits (a fake one here) leaves nothing to refuse the
    text by: the router tokenizes all of it, on a thread, and keeps answering meanwhile."""
    procs: list[Proc] = []
    try:
        procs.append(fake_engine(tmp_path, redis_url, "unlimited", "decode", "fake-0"))
        router = router_process(tmp_path, redis_url, "unlimited", "--tokenizer", "demo",
                                env={"KVFERRY_ROUTING_DECODE": "prefix-aware"})
        procs.append(router)
        wait_decode_pool(router)
        body = json.dumps({"model": "fake", "prompt": "w5 " * 2_600_000}).encode()
        answer, health_s = post_while_probing(router, "/v1/completions", body, router, "/health",
                                              timeout_s=60)
        assert answer.status_code == 200, answer.text
        metrics = httpx.get(url(router) + "/metrics", timeout=10).text
        assert 'kvferry:router_tokenized_prompts_total{where="router"} 1.0' in metrics
        assert max(health_s) < 1.0, health_s
    finally:
        for proc in procs:
            proc.stop()


def test_a_huge_chat_message_does_not_hold_the_pod(service: dict[str, Proc]) -> None:
    """Chat prompts are tokenized by a pod's /tokenize for routing: one that cannot fit is
    not sent there (where tokenizing it would hold the pod), and the pod refuses it."""
    router, pod = service["reading"], service["pod"]
    messages = [{"role": "user", "content": "w5 " * 2_600_000}]
    body = json.dumps({"model": "demo", "messages": messages, "max_tokens": 2}).encode()
    answer, ping_s = post_while_probing(router, "/v1/chat/completions", body, pod, "/ping")
    assert max(ping_s) < 1.0, ping_s
    assert answer_of(answer) == (400, "messages")
    assert "maximum model length" in answer.json()["error"]["message"]


@pytest.mark.parametrize("field", ["prompt", "messages"])
def test_a_huge_tokenize_does_not_hold_the_pod(service: dict[str, Proc], field: str) -> None:
    pod = service["pod"]
    text = "w5 " * 2_600_000
    query = ({"prompt": text} if field == "prompt"
             else {"messages": [{"role": "user", "content": text}]})
    body = json.dumps({"model": "demo", **query}).encode()
    answer, ping_s = post_while_probing(pod, "/tokenize", body, pod, "/ping", timeout_s=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["count"] >= 2_600_000
    assert max(ping_s) < 1.0, ping_s


def until_closed(proc: Proc, sent: bytes, wait_s: float = 10.0) -> tuple[bytes, float]:
    """Sends `sent` on a new connection, then reads until the server closes it: (what it
    answered, seconds from the send to the close)."""
    with socket.create_connection(("127.0.0.1", proc.port), timeout=wait_s) as conn:  # type: ignore[attr-defined]
        conn.sendall(sent)
        started = time.monotonic()
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
        return data, time.monotonic() - started


def error_of(answer: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)["error"]


SLOW_BODY = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: 100\r\n\r\n" + b'{"prompt": "w5"')


@pytest.mark.parametrize("target", ["pod", "limited"])
def test_a_body_shorter_than_its_length_is_a_408_within_the_body_timeout(
        service: dict[str, Proc], target: str) -> None:
    answer, closed_after = until_closed(service[target], SLOW_BODY)
    status, error = error_of(answer)
    assert (status, error["code"], error["type"]) == (408, "request_timeout",
                                                      "invalid_request_error")
    assert "--body-timeout" in error["message"]
    assert BODY_TIMEOUT_S - 0.1 < closed_after < BODY_TIMEOUT_S + 1.0


@pytest.mark.parametrize("target", ["pod", "limited"])
@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"],
                         ids=["silent", "half-headers"])
def test_a_request_without_its_headers_is_closed_within_the_header_timeout(
        service: dict[str, Proc], target: str, sent: bytes) -> None:
    answer, closed_after = until_closed(service[target], sent)
    assert answer == b""
    assert HEADER_TIMEOUT_S - 0.1 < closed_after < HEADER_TIMEOUT_S + 1.0


@pytest.mark.parametrize("target", ["pod", "limited"])
def test_an_idle_kept_alive_connection_is_closed_within_the_keep_alive_timeout(
        service: dict[str, Proc], target: str) -> None:
    answer, closed_after = until_closed(service[target], b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert closed_after < KEEP_ALIVE_TIMEOUT_S + 1.0


def test_connections_past_the_limit_are_a_503(service: dict[str, Proc]) -> None:
    router = service["limited"]
    address = ("127.0.0.1", router.port)  # type: ignore[attr-defined]
    held = [socket.create_connection(address, timeout=10) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # all of them accepted
        answer, closed_after = until_closed(router, b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        status, error = error_of(answer)
        assert (status, error["code"]) == (503, "service_unavailable")
        assert f"limit of {MAX_CONNECTIONS} open connections" in error["message"]
        assert closed_after < 1.5  # answered at once, closed after a short linger
    finally:
        for conn in held:
            conn.close()
    time.sleep(0.2)
    assert httpx.get(url(router) + "/ping", timeout=10).status_code == 200
