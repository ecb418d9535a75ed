"""The router's request flow against fake engine pods (real processes, real Redis)."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from kvferry_testing.procs import Proc, fake_engine, router_process

SERVICE = "flow"
LONG_PROMPT = " ".join(["word"] * 300)  # the fake tokenizer: one token per word
_prompts = itertools.count()


def long_prompt() -> str:
    """A long prompt no earlier one shares a block with (the fake tokenizer's token id is a
    word's length, so the leading words spell a fresh number): a decode pod that decoded a
    prompt holds its blocks, and the router skips the prefill hop for it the next time."""
    digits = [1 + int(d) for d in str(next(_prompts)).zfill(6)]
    return " ".join(["x" * d for d in digits] + ["word"] * 294)


def metric(router: Proc, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    text = httpx.get(f"http://127.0.0.1:{router.port}/metrics").text  # type: ignore[attr-defined]
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            sample, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in sample for k, v in labels.items()):
                total += float(value)
    return total


def received(pod: Proc) -> list[dict]:
    return httpx.get(f"http://127.0.0.1:{pod.port}/fake/requests").json()  # type: ignore[attr-defined]


def set_behaviour(pod: Proc, behaviour: str) -> None:
    httpx.post(f"http://127.0.0.1:{pod.port}/fake/behaviour",  # type: ignore[attr-defined]
               json={"behaviour": behaviour}).raise_for_status()


def wait_pools(router: Proc, expected: dict[str, list[str]], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    pools = None
    while time.monotonic() < deadline:
        pools = httpx.get(f"http://127.0.0.1:{router.port}/health").json()["pools"]  # type: ignore[attr-defined]
        if pools == expected:
            return
        time.sleep(0.05)
    raise AssertionError(f"pools {pools} != {expected}")


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[dict[str, Proc]]:
    """One prefill and two decode fake pods behind a router with API keys."""
    tmp = tmp_path_factory.mktemp("pd")
    keys = tmp / "keys"
    keys.write_text("key-one\nkey-two\n")
    procs: dict[str, Proc] = {}
    try:
        procs["prefill-0"] = fake_engine(tmp, redis_url, SERVICE, "prefill", "prefill-0")
        procs["decode-0"] = fake_engine(tmp, redis_url, SERVICE, "decode", "decode-0")
        procs["decode-1"] = fake_engine(tmp, redis_url, SERVICE, "decode", "decode-1")
        procs["router"] = router_process(tmp, redis_url, SERVICE, "--api-key-file", str(keys),
                                         "--max-body-bytes", "100000",
                                         env={"KVFERRY_ROUTING_DECODE": "round-robin"})
        wait_pools(procs["router"], {"decode": ["decode-0", "decode-1"], "prefill": ["prefill-0"]})
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def client(router: Proc, key: str = "key-two") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{router.port}/v1", api_key=key,  # type: ignore[attr-defined]
                         max_retries=0, timeout=10)


def test_long_prompt_goes_through_prefill_with_the_router_params(pd: dict[str, Proc]) -> None:
    before = len(received(pd["prefill-0"]))
    prompt = long_prompt()
    out = client(pd["router"]).completions.create(
        model="fake", prompt=prompt, max_tokens=5,
        extra_body={"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.6.6.6"}})
    assert out.choices[0].text == " a b c"
    prefill_body = received(pd["prefill-0"])[before]
    assert prefill_body["kv_transfer_params"] == {"do_remote_decode": True}
    assert (prefill_body["max_tokens"], prefill_body["stream"]) == (1, False)
    decoded = [b for pod in ("decode-0", "decode-1") for b in received(pd[pod])
               if b.get("prompt") == prompt]
    assert len(decoded) == 1
    # The prefill pod's params, never the client's.
    assert decoded[0]["kv_transfer_params"]["remote_engine_id"] == "prefill-0"
    assert decoded[0]["kv_transfer_params"]["remote_host"] == "127.0.0.1"


STRUCTURED = {
    "/v1/completions": {"prompt": LONG_PROMPT, "guided_regex": "[0-9]+",
                        "response_format": {"type": "json_object"}},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": LONG_PROMPT}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "parallel_tool_calls": False},
}


@pytest.mark.parametrize("endpoint", sorted(STRUCTURED))
def test_both_hops_carry_the_constraint_fields_unchanged(pd: dict[str, Proc],
                                                         endpoint: str) -> None:
    """The prefill pod samples the first token under the request's grammar and the decode
    pod runs it from the start: both get every constraint and tool field as the client
    sent it (and the router's /tokenize of a chat renders its tools too)."""
    fields = {**STRUCTURED[endpoint], "model": "fake", "max_tokens": 5}
    decodes = ("decode-0", "decode-1")
    before = {pod: len(received(pd[pod])) for pod in ("prefill-0", *decodes)}
    answer = httpx.post(f"http://127.0.0.1:{pd['router'].port}{endpoint}", json=fields,  # type: ignore[attr-defined]
                        headers={"Authorization": "Bearer key-one"}, timeout=10)
    assert answer.status_code == 200, answer.text
    [prefill_body] = received(pd["prefill-0"])[before["prefill-0"]:]
    [decode_body] = [b for pod in decodes for b in received(pd[pod])[before[pod]:]]
    for body in (prefill_body, decode_body):
        assert {k: body[k] for k in STRUCTURED[endpoint]} == STRUCTURED[endpoint]
    assert "do_remote_prefill" in decode_body["kv_transfer_params"]
    if endpoint == "/v1/chat/completions":
        queries = [q for pod in ("prefill-0", *decodes) for q in httpx.get(
            f"http://127.0.0.1:{pd[pod].port}/fake/tokenize_bodies").json()]  # type: ignore[attr-defined]
        mine = [q for q in queries if q.get("messages") == fields["messages"]]
        assert mine and all(q["tools"] == fields["tools"] for q in mine), queries


def test_short_prompt_skips_prefill(pd: dict[str, Proc]) -> None:
    skips = metric(pd["router"], "kvferry:router_prefill_skips_total")
    before = len(received(pd["prefill-0"]))
    out = client(pd["router"]).completions.create(
        model="fake", prompt="short prompt", max_tokens=5,
        extra_body={"kv_transfer_params": {"remote_host": "10.6.6.6"}})
    assert out.choices[0].text == " a b c"
    assert len(received(pd["prefill-0"])) == before
    assert metric(pd["router"], "kvferry:router_prefill_skips_total") == skips + 1
    decoded = [b for pod in ("decode-0", "decode-1") for b in received(pd[pod])
               if b.get("prompt") == "short prompt"]
    assert "kv_transfer_params" not in decoded[-1]


def decoded_by(pd: dict[str, Proc], prompt: str) -> list[str]:
    """The decode pods that got `prompt`, in the order they got it."""
    return [pod for pod in ("decode-0", "decode-1") for b in received(pd[pod])
            if b.get("prompt") == prompt]


def test_round_robin_skips_prefill_only_where_the_picked_decode_pod_holds_the_prompt(
        pd: dict[str, Proc]) -> None:
    """Round robin alternates the two decode pods whether or not a prefill hop runs (the
    turn is taken once); the third sending of one prompt comes back to the pod that decoded
    the first, which holds it: no prefill hop. The second went to the other pod: prefill."""
    router = pd["router"]
    prompt = long_prompt()
    prefilled = metric(router, "kvferry:router_hop_requests_total", hop="prefill")
    cached_skips = metric(router, "kvferry:router_prefill_skips_total", reason="cached_on_decode")
    prefill_before = len(received(pd["prefill-0"]))
    for _ in range(3):
        client(router).completions.create(model="fake", prompt=prompt, max_tokens=2)
    pods = decoded_by(pd, prompt)
    assert sorted(pods) == ["decode-0", "decode-0", "decode-1"] or \
        sorted(pods) == ["decode-0", "decode-1", "decode-1"], pods
    prefill_bodies = [b for b in received(pd["prefill-0"])[prefill_before:]
                      if b.get("prompt") == prompt]
    assert len(prefill_bodies) == 2
    assert metric(router, "kvferry:router_hop_requests_total", hop="prefill") == prefilled + 2
    assert metric(router, "kvferry:router_prefill_skips_total",
                  reason="cached_on_decode") == cached_skips + 1
    # A fresh prompt after them still takes its turn: the pods keep alternating.
    fresh = [long_prompt() for _ in range(4)]
    for other in fresh:
        client(router).completions.create(model="fake", prompt=other, max_tokens=2)
    turns = [decoded_by(pd, other)[0] for other in fresh]
    assert turns[0] != turns[1] and turns[1] != turns[2] and turns[2] != turns[3], turns


def test_least_loaded_decode_skips_prefill_for_a_prompt_its_pod_holds(
        tmp_path: Path, redis_url: str) -> None:
    """The default decode policy (least loaded) does not rank by prefix, but the skip asks
    the prefix index about the pod it picked: a prompt sent twice to a one-pod decode pool
    goes through the prefill pod once."""
    service = "skip-cached"
    prefill = fake_engine(tmp_path, redis_url, service, "prefill", "prefill-0")
    decode = fake_engine(tmp_path, redis_url, service, "decode", "decode-0")
    router = router_process(tmp_path, redis_url, service)
    try:
        wait_pools(router, {"decode": ["decode-0"], "prefill": ["prefill-0"]})
        prompt = long_prompt()
        for _ in range(2):
            out = client(router).completions.create(model="fake", prompt=prompt, max_tokens=2)
            assert out.choices[0].text == " a b c"  # the fake pod's answer
        assert [b["prompt"] for b in received(prefill)] == [prompt]
        bodies = received(decode)
        assert [b["prompt"] for b in bodies] == [prompt, prompt]
        assert "kv_transfer_params" in bodies[0] and "kv_transfer_params" not in bodies[1]
        assert metric(router, "kvferry:router_prefill_skips_total",
                      reason="cached_on_decode") == 1
    finally:
        for proc in (prefill, decode, router):
            proc.stop()


@pytest.mark.parametrize("asks", [{"prompt_logprobs": 1}, {"echo": True, "logprobs": 0}])
def test_a_request_scoring_its_prompt_skips_the_prefill_hop(pd: dict[str, Proc],
                                                            asks: dict) -> None:
    """Prompt logprobs need every prompt position computed on the answering pod: the long
    prompt goes straight to a decode pod, counted as a skip."""
    router = pd["router"]
    skips = metric(router, "kvferry:router_prefill_skips_total", reason="prompt_logprobs")
    before = len(received(pd["prefill-0"]))
    prompt = long_prompt()
    client(router).completions.create(model="fake", prompt=prompt, max_tokens=2, extra_body=asks)
    assert len(received(pd["prefill-0"])) == before
    (pod,) = decoded_by(pd, prompt)
    body = [b for b in received(pd[pod]) if b.get("prompt") == prompt][0]
    assert "kv_transfer_params" not in body
    assert metric(router, "kvferry:router_prefill_skips_total",
                  reason="prompt_logprobs") == skips + 1


def test_streamed_chat_passes_chunk_by_chunk(pd: dict[str, Proc]) -> None:
    stream = client(pd["router"]).chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert [c.choices[0].delta.content for c in stream] == [" a", " b", " c"]


def test_wrong_api_key_gets_401(pd: dict[str, Proc]) -> None:
    with pytest.raises(openai.AuthenticationError):
        client(pd["router"], key="wrong").completions.create(model="fake", prompt="x")
    assert httpx.get(f"http://127.0.0.1:{pd['router'].port}/v1/models").status_code == 401  # type: ignore[attr-defined]


def test_body_over_the_limit_gets_413(pd: dict[str, Proc]) -> None:
    response = httpx.post(f"http://127.0.0.1:{pd['router'].port}/v1/completions",  # type: ignore[attr-defined]
                          headers={"Authorization": "Bearer key-one"},
                          json={"model": "fake", "prompt": "x" * 200_000})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_bad_json_gets_openai_shaped_400(pd: dict[str, Proc]) -> None:
    response = httpx.post(f"http://127.0.0.1:{pd['router'].port}/v1/completions",  # type: ignore[attr-defined]
                          headers={"Authorization": "Bearer key-one"}, content=b"{not json")
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_failing_prefill_falls_back_to_decode(pd: dict[str, Proc]) -> None:
    fallbacks = metric(pd["router"], "kvferry:router_prefill_fallbacks_total")
    set_behaviour(pd["prefill-0"], "refuse")
    try:
        out = client(pd["router"]).completions.create(model="fake", prompt=long_prompt())
    finally:
        set_behaviour(pd["prefill-0"], "ok")
    assert out.choices[0].text == " a b c"
    assert metric(pd["router"], "kvferry:router_prefill_fallbacks_total",
                  reason="prefill_failed") == fallbacks + 1


def test_refusing_decode_pod_is_retried_on_the_other(pd: dict[str, Proc]) -> None:
    retries = metric(pd["router"], "kvferry:router_retries_total", hop="decode")
    set_behaviour(pd["decode-0"], "refuse")
    try:
        texts = [client(pd["router"]).completions.create(model="fake", prompt="p").choices[0].text
                 for _ in range(4)]
    finally:
        set_behaviour(pd["decode-0"], "ok")
    assert texts == [" a b c"] * 4
    assert metric(pd["router"], "kvferry:router_retries_total", hop="decode") >= retries + 1


def test_a_pod_error_reaches_the_client_as_the_pods_own_error_object(
        pd: dict[str, Proc], tmp_path: Path, redis_url: str) -> None:
    """Both decode pods answer 503: the client gets the last one's status and error object as
    the pod sent it, not the router's 502 with the pod's JSON escaped inside its message."""
    # A router of its own: the pods it finds failing are set aside by it alone.
    router = router_process(tmp_path, redis_url, SERVICE)
    decodes = ("decode-0", "decode-1")
    try:
        wait_pools(router, {"decode": list(decodes), "prefill": ["prefill-0"]})
        for pod in decodes:
            set_behaviour(pd[pod], "refuse")
        response = httpx.post(f"http://127.0.0.1:{router.port}/v1/completions",  # type: ignore[attr-defined]
                              json={"model": "fake", "prompt": "p"}, timeout=30)
    finally:
        for pod in decodes:
            set_behaviour(pd[pod], "ok")
        router.stop()
    assert response.status_code == 503, response.text
    assert response.json() == {"error": {"message": "refusing"}}
    assert response.headers["x-request-id"]


def test_version_says_the_routers_release(pd: dict[str, Proc]) -> None:
    import kvferry

    response = httpx.get(f"http://127.0.0.1:{pd['router'].port}/version")  # type: ignore[attr-defined]
    assert response.status_code == 200
    assert response.json() == {"version": kvferry.__version__}


def test_decode_dying_mid_stream_ends_with_an_error_event(pd: dict[str, Proc]) -> None:
    for pod in ("decode-0", "decode-1"):
        set_behaviour(pd[pod], "cut")
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{pd['router'].port}/v1/completions",  # type: ignore[attr-defined]
                          headers={"Authorization": "Bearer key-one"},
                          json={"model": "fake", "prompt": "p", "stream": True}) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
    finally:
        for pod in ("decode-0", "decode-1"):
            set_behaviour(pd[pod], "ok")
    assert json.loads(events[0][6:])["choices"][0]["text"] == " a"
    assert json.loads(events[-2][6:])["error"]["code"] == "bad_gateway"
    assert events[-1] == "data: [DONE]"


def test_a_stream_dropped_before_its_first_chunk_is_retried_on_the_other_pod(
        pd: dict[str, Proc], tmp_path: Path, redis_url: str) -> None:
    """An engine sends a stream's headers when it takes the request: a pod that dies before
    the first token leaves the router free to go elsewhere, the client having seen nothing."""
    # A router of its own: no pod set aside by earlier tests, so round robin tries decode-0.
    router = router_process(tmp_path, redis_url, SERVICE,
                            env={"KVFERRY_ROUTING_DECODE": "round-robin"})
    set_behaviour(pd["decode-0"], "drop")
    try:
        wait_pools(router, {"decode": ["decode-0", "decode-1"], "prefill": ["prefill-0"]})
        texts = [[c.choices[0].text for c in client(router).completions.create(
            model="fake", prompt="p", stream=True)] for _ in range(4)]
        assert texts == [[" a", " b", " c"]] * 4
        assert metric(router, "kvferry:router_retries_total", hop="decode") >= 1
        assert metric(router, "kvferry:router_stream_errors_total") == 0
    finally:
        set_behaviour(pd["decode-0"], "ok")
        router.stop()


def test_requests_held_by_prefill_together_spread_over_the_decode_pods(
        pd: dict[str, Proc], tmp_path: Path, redis_url: str) -> None:
    """The decode pod is chosen when the decode hop goes: requests that waited on prefill
    together do not all land on the pod that was least loaded when they came in."""
    router = router_process(tmp_path, redis_url, SERVICE,
                            env={"KVFERRY_ROUTING_DECODE": "least-loaded"})
    decodes = ("decode-0", "decode-1")
    pods = ("prefill-0", *decodes)
    try:
        wait_pools(router, {"decode": list(decodes), "prefill": ["prefill-0"]})
        before = {pod: len(received(pd[pod])) for pod in pods}
        for pod in pods:  # every pod holds what it gets, so each hop's load stays counted
            set_behaviour(pd[pod], "hold")
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(client(router).completions.create, model="fake",
                                   prompt=long_prompt()) for _ in range(4)]
            wait_received(pd, ("prefill-0",), before, 4)
            set_behaviour(pd["prefill-0"], "ok")
            wait_received(pd, decodes, before, 4)
            decoded = {pod: len(received(pd[pod])) - before[pod] for pod in decodes}
            for pod in decodes:
                set_behaviour(pd[pod], "ok")
            texts = [future.result().choices[0].text for future in futures]
    finally:
        for pod in pods:
            set_behaviour(pd[pod], "ok")
        router.stop()
    assert texts == [" a b c"] * 4
    assert decoded == {"decode-0": 2, "decode-1": 2}, decoded


def wait_received(pd: dict[str, Proc], pods: tuple[str, ...], before: dict[str, int],
                  num: int) -> None:
    """Until `pods` together received `num` more requests than `before`."""
    deadline = time.monotonic() + 10
    while sum(len(received(pd[pod])) - before[pod] for pod in pods) < num:
        assert time.monotonic() < deadline, [received(pd[pod]) for pod in pods]
        time.sleep(0.02)


def test_requests_while_the_prefill_pool_is_down_are_counted_as_fallbacks(
        tmp_path: Path, redis_url: str) -> None:
    service = "prefill-down"
    prefill = fake_engine(tmp_path, redis_url, service, "prefill", "prefill-0")
    decode = fake_engine(tmp_path, redis_url, service, "decode", "decode-0")
    router = router_process(tmp_path, redis_url, service)
    try:
        wait_pools(router, {"decode": ["decode-0"], "prefill": ["prefill-0"]})
        prefill.stop()  # its key goes at once: the pool is empty, not failing
        wait_pools(router, {"decode": ["decode-0"]})
        prompts = [long_prompt(), "short"]
        for prompt in prompts:
            out = client(router).completions.create(model="fake", prompt=prompt)
            assert out.choices[0].text == " a b c"
        assert metric(router, "kvferry:router_prefill_fallbacks_total",
                      reason="no_live_prefill_pod") == 2
        assert [b["prompt"] for b in received(decode)] == prompts
    finally:
        for proc in (prefill, decode, router):
            proc.stop()


def test_no_live_pod_gets_503(tmp_path: Path, redis_url: str) -> None:
    router = router_process(tmp_path, redis_url, "empty-service")
    try:
        response = httpx.post(f"http://127.0.0.1:{router.port}/v1/completions",  # type: ignore[attr-defined]
                              json={"model": "fake", "prompt": "p"})
        assert response.status_code == 503
        assert "no live pod" in response.json()["error"]["message"]
        assert httpx.get(f"http://127.0.0.1:{router.port}/health").status_code == 503  # type: ignore[attr-defined]
    finally:
        router.stop()


def test_a_stopped_pod_leaves_the_registry_at_once(tmp_path: Path, redis_url: str) -> None:
    a = fake_engine(tmp_path, redis_url, "leaving", "both", "pod-a")
    b = fake_engine(tmp_path, redis_url, "leaving", "both", "pod-b")
    router = router_process(tmp_path, redis_url, "leaving")
    try:
        wait_pools(router, {"decode": ["pod-a", "pod-b"]})
        a.stop()
        wait_pools(router, {"decode": ["pod-b"]}, timeout_s=1.0)  # well under the key's TTL
        out = client(router).completions.create(model="fake", prompt="p")
        assert out.choices[0].text == " a b c"
    finally:
        for proc in (a, b, router):
            proc.stop()


def test_stuck_pods_cannot_hang_a_client(pd: dict[str, Proc], tmp_path: Path,
                                         redis_url: str) -> None:
    router = router_process(tmp_path, redis_url, SERVICE, "--decode-timeout", "0.5")
    for pod in ("decode-0", "decode-1"):
        set_behaviour(pd[pod], "hang")
    try:
        started = time.monotonic()
        response = httpx.post(f"http://127.0.0.1:{router.port}/v1/completions",  # type: ignore[attr-defined]
                              json={"model": "fake", "prompt": "p"}, timeout=30)
        elapsed = time.monotonic() - started
    finally:
        for pod in ("decode-0", "decode-1"):
            set_behaviour(pd[pod], "ok")
        router.stop()
    # One try and one retry, each cut off after half a second.
    assert response.status_code == 502 and elapsed < 5, (response.status_code, elapsed)
    assert "TimeoutError" in response.json()["error"]["message"]


def test_the_router_keeps_its_connections_to_the_pods_alive(pd: dict[str, Proc]) -> None:
    def connections(pod: Proc) -> int:
        return httpx.get(f"http://127.0.0.1:{pod.port}/fake/connections").json()  # type: ignore[attr-defined]

    before = {name: connections(pd[name]) for name in ("decode-0", "decode-1")}
    for stream in (False, True) * 4:
        out = client(pd["router"]).completions.create(model="fake", prompt="kept", stream=stream)
        if stream:
            assert "".join(c.choices[0].text for c in out) == " a b c"  # type: ignore[union-attr]
    # Round robin: four requests each, on one connection each (a connection idle from an
    # earlier test may have been replaced once).
    opened = {name: connections(pd[name]) - before[name] for name in before}
    assert all(n in (0, 1) for n in opened.values()), opened


def test_deeply_nested_json_gets_openai_shaped_400(pd: dict[str, Proc]) -> None:
    depth = 40_000
    body = b'{"model":"fake","prompt":' + b"[" * depth + b"]" * depth + b"}"
    response = httpx.post(f"http://127.0.0.1:{pd['router'].port}/v1/completions",  # type: ignore[attr-defined]
                          headers={"Authorization": "Bearer key-one",
                                   "content-type": "application/json"}, content=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_json")
    assert "nested too deeply" in error["message"]


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v1/completions", 405), ("GET", "/v1/chat/completions", 405),
    ("GET", "/v1/nothing-here", 404), ("POST", "/nothing-here", 404),
    ("POST", "/v1/models", 405)])
def test_unknown_paths_and_methods_get_openai_shaped_errors(
        pd: dict[str, Proc], method: str, path: str, status: int) -> None:
    response = httpx.request(method, f"http://127.0.0.1:{pd['router'].port}{path}",  # type: ignore[attr-defined]
                             headers={"Authorization": "Bearer key-one"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert error["message"] == ("Not Found" if status == 404 else "Method Not Allowed")
    if status == 405:
        assert "POST" in response.headers["allow"] or "GET" in response.headers["allow"]


@pytest.mark.parametrize("extra", [
    {"prompt": LONG_PROMPT, "n": 2},
    {"prompt": [LONG_PROMPT, LONG_PROMPT + " more"]},
    {"prompt": [list(range(300)), list(range(1, 301))]},
], ids=["n2", "text-batch", "token-batch"])
def test_requests_a_prefill_pod_cannot_hand_over_skip_the_prefill_hop(
        pd: dict[str, Proc], extra: dict) -> None:
    """A prefill pod hands over one sequence's KV: n > 1 and batches go straight to decode,
    by choice (a skip), not after a prefill hop that could only fail (a fallback)."""
    router = pd["router"]
    skips = metric(router, "kvferry:router_prefill_skips_total", reason="not_one_prompt")
    fallbacks = metric(router, "kvferry:router_prefill_fallbacks_total")
    before = len(received(pd["prefill-0"]))
    decodes = ("decode-0", "decode-1")
    decoded_before = {pod: len(received(pd[pod])) for pod in decodes}
    response = httpx.post(f"http://127.0.0.1:{router.port}/v1/completions",  # type: ignore[attr-defined]
                          headers={"Authorization": "Bearer key-one"},
                          json={"model": "fake", "max_tokens": 5, **extra})
    assert response.status_code == 200, response.text
    assert len(received(pd["prefill-0"])) == before
    assert metric(router, "kvferry:router_prefill_skips_total",
                  reason="not_one_prompt") == skips + 1
    assert metric(router, "kvferry:router_prefill_fallbacks_total") == fallbacks
    decoded = [b for pod in decodes for b in received(pd[pod])[decoded_before[pod]:]]
    assert decoded == [{"model": "fake", "max_tokens": 5, **extra}]


def test_a_request_the_prefill_pod_refuses_gets_its_error_without_a_fallback(
        pd: dict[str, Proc]) -> None:
    """A 400 from the prefill pod says the request is wrong: the decode pod would refuse it
    too, so the client gets that 400 as it is, and nothing is counted as a fallback."""
    router = pd["router"]
    fallbacks = metric(router, "kvferry:router_prefill_fallbacks_total")
    decoded_before = sum(len(received(pd[pod])) for pod in ("decode-0", "decode-1"))
    set_behaviour(pd["prefill-0"], "invalid")
    try:
        with pytest.raises(openai.BadRequestError) as caught:
            client(router).completions.create(model="fake", prompt=long_prompt(), max_tokens=99)
    finally:
        set_behaviour(pd["prefill-0"], "ok")
    assert caught.value.status_code == 400
    assert caught.value.body == {"message": "max_tokens: must be at most 16",
                                 "type": "invalid_request_error", "param": "max_tokens",
                                 "code": None}
    assert metric(router, "kvferry:router_prefill_fallbacks_total") == fallbacks
    assert sum(len(received(pd[pod])) for pod in ("decode-0", "decode-1")) == decoded_before


def test_sigterm_lets_a_request_in_flight_finish(pd: dict[str, Proc], tmp_path: Path,
                                                  redis_url: str) -> None:
    """A stopping router refuses new connections but answers the requests it holds: one the
    decode pod takes a while over (longer than uvicorn's few seconds) still gets its 200."""
    router = router_process(tmp_path, redis_url, SERVICE)
    decodes = ("decode-0", "decode-1")
    try:
        wait_pools(router, {"decode": list(decodes), "prefill": ["prefill-0"]})
        before = {pod: len(received(pd[pod])) for pod in decodes}
        for pod in decodes:
            set_behaviour(pd[pod], "hold")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(httpx.post, f"http://127.0.0.1:{router.port}/v1/completions",  # type: ignore[attr-defined]
                                 json={"model": "fake", "prompt": "held"}, timeout=60)
            wait_received(pd, decodes, before, 1)
            router.proc.send_signal(signal.SIGTERM)
            # Longer than a short fixed shutdown grace would let the request run.
            time.sleep(4)
            assert router.proc.poll() is None, router.log()
            for pod in decodes:
                set_behaviour(pd[pod], "ok")
            response = future.result()
        assert router.proc.wait(20) == 0, router.log()
    finally:
        for pod in decodes:
            set_behaviour(pd[pod], "ok")
        router.stop()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == " a b c"
    assert "Traceback" not in router.log(), router.log()
    # The router says what it waits for: at the signal, then each second of the drain.
    log = router.log()
    assert "kvferry.router: SIGTERM: draining 1 request (/v1/completions 1) in flight for up " \
           "to 30 s; new connections are refused" in log, log
    assert len(re.findall(r"kvferry.router: draining: 1 request \(/v1/completions 1\) in "
                          r"flight, \d+ s left", log)) >= 2, log
