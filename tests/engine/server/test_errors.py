"""Bad input gets a 4xx in OpenAI's error shape naming the field, and the server keeps
serving; schema fuzzing of both generation endpoints finds no 5xx."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry_testing.serve_helpers import MAX_MODEL_LEN, ServerProcess


@pytest.fixture(scope="module")
def http(live_server: ServerProcess) -> httpx.Client:
    with httpx.Client(base_url=live_server.url, headers=live_server.headers, timeout=60) as c:
        yield c


def assert_error(response: httpx.Response, status: int, param: str | None,
                 *words: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    for word in words:
        assert word in error["message"], error["message"]
    return error


def assert_still_serving(http: httpx.Client) -> None:
    out = http.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] >= 1


BAD_COMPLETIONS = [
    ({"prompt": "w5", "max_tokens": -1}, "max_tokens", ["max_tokens", ">= 1", "-1"]),
    ({"prompt": "w5", "temperature": "hot"}, "temperature", ["temperature", "number"]),
    ({"prompt": "w5", "top_p": 1.5}, "top_p", ["top_p", "(0, 1]"]),
    ({"prompt": "w5", "n": 0}, "n", ["n must be >= 1"]),
    ({"prompt": "w5", "logprobs": 50}, "logprobs", ["logprobs", "20"]),
    ({"prompt": "w5", "presence_penalty": 3}, "presence_penalty", ["presence_penalty", "2"]),
    ({"prompt": "w5", "stop": [""]}, "stop", ["stop[0]"]),
    ({"prompt": "w5", "seed": 2**70}, "seed", ["seed"]),
    ({"prompt": "w5", "stop_token_ids": [9999]}, "stop_token_ids", ["vocabulary", "256"]),
    ({"prompt": " ".join(["w5"] * (MAX_MODEL_LEN + 1))}, "prompt",
     [str(MAX_MODEL_LEN + 1), f"maximum model length of {MAX_MODEL_LEN}"]),
    ({"prompt": "w5 w6", "max_tokens": MAX_MODEL_LEN}, "max_tokens",
     ["max_tokens", str(MAX_MODEL_LEN)]),
    ({"prompt": [5, 6, 4000]}, "prompt", ["4000", "outside the vocabulary [0, 256)"]),
    ({"prompt": [[5], [-1]]}, "prompt", ["-1", "vocabulary"]),
    ({"prompt": []}, "prompt", ["prompt"]),
    ({"max_tokens": 3}, "prompt", ["prompt", "required"]),
    ({"prompt": {"text": "w5"}}, "prompt", ["prompt"]),
    ({"prompt": "w5", "suffix": "the end"}, "suffix", ["suffix", "not supported"]),
    ({"prompt": "w5", "prompt_logprobs": 21}, "prompt_logprobs", ["prompt_logprobs", "20"]),
    ({"prompt": "w5", "logit_bias": {"5": 101}}, "logit_bias", ["logit_bias[5]", "100"]),
]


@pytest.mark.parametrize(("body", "param", "words"), BAD_COMPLETIONS,
                         ids=[p for _, p, _ in BAD_COMPLETIONS])
def test_bad_completion_fields(http: httpx.Client, body: dict[str, Any], param: str,
                               words: list[str]) -> None:
    assert_error(http.post("/v1/completions", json=body), 400, param, *words)
    assert_still_serving(http)


BAD_CHATS = [
    ({"max_tokens": 3}, "messages", ["messages", "required"]),
    ({"messages": []}, "messages", ["messages"]),
    ({"messages": [{"content": "w5"}]}, "messages[0].role", ["role"]),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]", ["image_url"]),
    ({"messages": [{"role": "user", "content": "w5"}], "top_logprobs": 2}, "top_logprobs",
     ["logprobs"]),
    ({"messages": [{"role": "user", "content": "w5"}], "max_completion_tokens": 0},
     "max_tokens", ["max_tokens must be >= 1"]),
    ({"messages": [{"role": "user", "content": "w5"}], "temperature": "hot"}, "temperature",
     ["temperature"]),
]


@pytest.mark.parametrize(("body", "param", "words"), BAD_CHATS,
                         ids=[p for _, p, _ in BAD_CHATS])
def test_bad_chat_fields(http: httpx.Client, body: dict[str, Any], param: str,
                         words: list[str]) -> None:
    assert_error(http.post("/v1/chat/completions", json=body), 400, param, *words)
    assert_still_serving(http)


def test_malformed_json_is_a_400(http: httpx.Client) -> None:
    for raw in (b"{not json", b"[1, 2]", b"", b'"text"', b"\xff\xfe"):
        response = http.post("/v1/completions", content=raw,
                             headers={"Content-Type": "application/json"})
        assert_error(response, 400, response.json()["error"]["param"])
    assert_still_serving(http)


# Bodies spelling a lone UTF-16 surrogate as a JSON escape (valid JSON, not valid Unicode),
# in every kind of text field that reaches the tokenizer or the detokenizer.
LONE_SURROGATES = [
    ("/v1/completions", r'{"prompt": "\ud800 x", "max_tokens": 2}', "prompt", "prompt"),
    ("/v1/completions", r'{"prompt": ["w5", "w6 \udfff"]}', "prompt", "prompt[1]"),
    ("/v1/completions", r'{"prompt": "w5", "stop": ["\ud800"]}', "stop", "stop[0]"),
    ("/v1/completions", r'{"prompt": "w5", "stop": "w6\udc00"}', "stop", "stop"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "\ud800"}]}',
     "messages", "messages[0].content"),
    ("/v1/chat/completions",
     r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\ud83d"}]}]}',
     "messages", "messages[0].content[0].text"),
    ("/v1/chat/completions", (r'{"messages": [{"role": "user", "content": "w5"}], '
                              r'"chat_template_kwargs": {"system": "\ud800"}}'),
     "chat_template_kwargs",
     "chat_template_kwargs.system"),
    ("/tokenize", r'{"prompt": "\ud800"}', "prompt", "prompt"),
    ("/tokenize", r'{"messages": [{"role": "user\ud800", "content": "w5"}]}', "messages",
     "messages[0].role"),
]


@pytest.mark.parametrize(("path", "raw", "param", "where"), LONE_SURROGATES,
                         ids=[w for _, _, _, w in LONE_SURROGATES])
def test_a_lone_surrogate_is_a_400_naming_its_field(http: httpx.Client,
                                                    live_server: ServerProcess, path: str,
                                                    raw: str, param: str, where: str) -> None:
    response = http.post(path, content=raw.encode(), headers={"Content-Type": "application/json"})
    assert_error(response, 400, param, f"{where} holds a lone UTF-16 surrogate",
                 "valid Unicode")
    assert "TypeError" not in live_server.log() and "codec" not in live_server.log()
    # A surrogate pair is one valid character.
    pair = http.post("/tokenize", content=rb'{"prompt": "w5 \ud83d\ude00"}',
                     headers={"Content-Type": "application/json"})
    assert pair.status_code == 200, pair.text
    assert_still_serving(http)


def test_unknown_model_is_a_404(http: httpx.Client) -> None:
    error = assert_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "w5"}),
                         404, "model", "gpt-9")
    assert error["code"] == "model_not_found"
    assert_error(http.post("/v1/chat/completions", json={
        "model": "gpt-9", "messages": [{"role": "user", "content": "w5"}]}), 404, "model")
    assert_still_serving(http)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": "test-key"}])
def test_missing_or_wrong_api_key_is_a_401(live_server: ServerProcess,
                                           headers: dict[str, str]) -> None:
    for path, body in (("/v1/completions", {"prompt": "w5"}),
                       ("/v1/chat/completions", {"messages": []}), ("/tokenize", {})):
        response = httpx.post(f"{live_server.url}{path}", json=body, headers=headers)
        assert_error(response, 401, None, "API key")
    assert httpx.get(f"{live_server.url}/v1/models", headers=headers).status_code == 401
    # Probes and metrics stay open for the kubelet and Prometheus.
    for path in ("/health", "/ping", "/metrics", "/version"):
        assert httpx.get(f"{live_server.url}{path}", headers=headers).status_code == 200


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing"), 404, None)
    assert_error(http.get("/v1/completions"), 405, None)


def test_request_id_is_honoured_or_made(http: httpx.Client, live_server: ServerProcess) -> None:
    response = http.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2},
                         headers={"X-Request-Id": "trace-abc-123"})
    assert response.headers["x-request-id"] == "trace-abc-123"
    made = http.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2})
    assert len(made.headers["x-request-id"]) == 32
    error = http.post("/v1/completions", json={"prompt": "w5", "max_tokens": -1},
                      headers={"X-Request-Id": "trace-bad-1"})
    assert error.headers["x-request-id"] == "trace-bad-1"
    log = live_server.log()
    (line,) = [x for x in log.splitlines() if "request_id=trace-abc-123" in x]
    assert "prompt_tokens=1" in line and "output_tokens=2" in line
    assert "finish_reason=length" in line and "latency_s=" in line
    assert "w5" not in line  # no prompt text unless asked
    (refused,) = [x for x in log.splitlines() if "request_id=trace-bad-1" in x]
    assert "status=400" in refused and "max_tokens must be >= 1" in refused


def test_tokenize_and_detokenize(http: httpx.Client) -> None:
    out = http.post("/tokenize", json={"prompt": "w5 w6 w300"}).json()
    assert out == {"count": 3, "max_model_len": MAX_MODEL_LEN, "tokens": [5, 6, 0],
                   "token_strs": None}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "w7"}],
                                        "return_token_strs": True}).json()
    assert chat["tokens"] == [0, 7, 0] and chat["token_strs"] == ["<unk>", "w7", "<unk>"]
    assert http.post("/detokenize", json={"tokens": [5, 6, 7]}).json() == {"prompt": "w5 w6 w7"}
    assert_error(http.post("/detokenize", json={"tokens": [5, 256]}), 400, "tokens", "256")
    assert_error(http.post("/tokenize", json={}), 400, "prompt")


def test_version_and_models(http: httpx.Client) -> None:
    assert http.get("/version").json()["version"]
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN


# ---- schema fuzzing ----------------------------------------------------------------------

def _floats(*args: float, **kwargs: bool) -> st.SearchStrategy[float]:
    """Floats without subnormals: other tests may load code built with flush-to-zero, which
    this process then runs with, and hypothesis refuses subnormals there."""
    return st.floats(*args, allow_subnormal=False, **kwargs)


# Any JSON value: what a hostile or buggy client may send for a field.
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | _floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=3),
    max_leaves=6,
)
# Valid values of every field (bodies built from them are mostly accepted) ...
VALID_SAMPLING = {
    "model": st.just("tiny"),
    "n": st.integers(1, 3),
    "temperature": _floats(0, 2),
    "top_p": _floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": _floats(0, 1),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4),
                                                        max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 255), max_size=3),
    "presence_penalty": _floats(-2, 2),
    "frequency_penalty": _floats(-2, 2),
    "repetition_penalty": _floats(0.5, 2),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 2),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "priority": st.integers(-10, 10),
    "user": st.text(max_size=5),
    "max_tokens": st.integers(2, 8),
}
VALID_PROMPTS = (st.text(min_size=1, max_size=20) | st.lists(st.integers(0, 255), min_size=1,
                                                             max_size=6)
                 | st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=3))
VALID_COMPLETION = st.fixed_dictionaries({"prompt": VALID_PROMPTS}, optional={
    **VALID_SAMPLING, "logprobs": st.integers(0, 5), "echo": st.booleans(),
    "prompt_logprobs": st.integers(0, 3),
    "logit_bias": st.dictionaries(st.integers(0, 255).map(str), st.floats(-100, 100),
                                  max_size=3)})
VALID_MESSAGES = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant"]),
    "content": st.text(max_size=12)}), min_size=1, max_size=3)
VALID_CHAT = st.fixed_dictionaries({"messages": VALID_MESSAGES}, optional={
    **VALID_SAMPLING, "logprobs": st.booleans(), "max_completion_tokens": st.integers(2, 8),
    "add_generation_prompt": st.booleans()})
# ... and any JSON for any field: a hostile or buggy client.
COMPLETION_FIELDS = [*VALID_SAMPLING, "prompt", "logprobs", "echo", "add_special_tokens",
                     "prompt_logprobs", "logit_bias", "allowed_token_ids", "suffix"]
CHAT_FIELDS = [*VALID_SAMPLING, "messages", "logprobs", "top_logprobs", "max_completion_tokens",
               "add_generation_prompt", "chat_template_kwargs"]
ANY_VALUE = JSON_VALUES | st.integers() | _floats(allow_nan=False)


def _perturbed(valid: st.SearchStrategy, fields: list[str]) -> st.SearchStrategy:
    """A valid body with one to three fields replaced by arbitrary JSON."""
    changes = st.dictionaries(st.sampled_from(fields), ANY_VALUE, min_size=1, max_size=3)
    return st.tuples(valid, changes).map(lambda pair: {**pair[0], **pair[1]})


def _arbitrary(fields: list[str]) -> st.SearchStrategy:
    return st.dictionaries(st.sampled_from(fields), ANY_VALUE, max_size=6)


COMPLETION_BODIES = st.one_of(VALID_COMPLETION, _perturbed(VALID_COMPLETION, COMPLETION_FIELDS),
                              _arbitrary(COMPLETION_FIELDS))
CHAT_BODIES = st.one_of(VALID_CHAT, _perturbed(VALID_CHAT, CHAT_FIELDS), _arbitrary(CHAT_FIELDS))


# Status codes the fuzzers saw, by path: the strategies must reach both valid and invalid.
FUZZ_STATUSES: dict[str, Counter[int]] = {}


def _check_no_5xx(http: httpx.Client, path: str, body: dict[str, Any]) -> None:
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8  # keep every accepted request short
    if isinstance(body.get("n"), int) and body["n"] > 3:
        body["n"] = 3
    body.setdefault("max_tokens", 4)
    response = http.post(path, content=json.dumps(body),
                         headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    FUZZ_STATUSES.setdefault(path, Counter())[response.status_code] += 1
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    elif body.get("stream") is True:
        assert response.text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in response.text, response.text


FUZZ_SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                         suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                HealthCheck.too_slow])


@FUZZ_SETTINGS
@given(body=COMPLETION_BODIES)
def test_fuzz_completions_never_5xx(http: httpx.Client, body: dict[str, Any]) -> None:
    _check_no_5xx(http, "/v1/completions", body)


@FUZZ_SETTINGS
@given(body=CHAT_BODIES)
def test_fuzz_chat_never_5xx(http: httpx.Client, body: dict[str, Any]) -> None:
    _check_no_5xx(http, "/v1/chat/completions", body)


def test_fuzzing_left_the_server_serving(http: httpx.Client) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        statuses = FUZZ_STATUSES.get(path, Counter())
        assert statuses[200] >= 30 and statuses[400] >= 30, (path, statuses)
    assert_still_serving(http)
    assert http.get("/health").status_code == 200
