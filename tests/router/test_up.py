"""`kvferry up` of a real service (demo model, two engine pods, prefix-aware routing): the
official openai client through the router gets what a single server gives."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from procs import Proc, free_port, wait_http

from kvferry.router.kv_events import split_hashes
from kvferry.router.prefix_index import prompt_block_hashes

SERVICE_NAME = "uptest"
KV_BYTES = str(32 * 1024 * 1024)
MODEL_FLAGS = ["--max-model-len", "1024", "--kv-cache-memory-bytes", KV_BYTES,
               "--block-size", "16", "--dtype", "float32"]
# Words of the demo tokenizer's vocabulary, so a prompt's token count is predictable enough.
SHARED_PREFIX = " ".join(["the history of the river and the town"] * 24)
MESSAGES = [{"role": "user", "content": "Tell me about the river."}]


def service_yaml(tmp: Path) -> Path:
    manifest = {
        "apiVersion": "kvferry.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": SERVICE_NAME},
        "spec": {
            "model": {"source": "demo", "dtype": "float32", "maxModelLen": 1024},
            "engine": {"blockSize": 16, "maxNumSeqs": 2,
                       "extraArgs": ["--kv-cache-memory-bytes", KV_BYTES]},
            "pools": {"decode": {"replicas": 2}},
            "router": {"routing": {"decode": "prefix-aware"}},
        },
    }
    path = tmp / "service.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, dict[str, str]]]:
    """`kvferry up` of the service; yields it and pod name -> URL."""
    tmp = tmp_path_factory.mktemp("up")
    port = free_port()
    proc = Proc([sys.executable, "-m", "kvferry.engine.cli", "up", "-f", str(service_yaml(tmp)),
                 "--port", str(port)], tmp / "up.log")
    proc.port = port  # type: ignore[attr-defined]
    try:
        deadline = time.monotonic() + 240
        while "ready: http" not in proc.log():
            assert proc.proc.poll() is None and time.monotonic() < deadline, proc.log()
            time.sleep(0.2)
        pods = dict(re.findall(r"pod (\S+): (http://127\.0\.0\.1:\d+)", proc.log()))
        assert sorted(pods) == [f"{SERVICE_NAME}-decode-0", f"{SERVICE_NAME}-decode-1"]
        yield proc, pods
    finally:
        assert proc.stop(timeout_s=60) == 0, proc.log()
        assert "Traceback" not in proc.log(), proc.log()


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """One colocated `kvferry serve`, the reference."""
    tmp = tmp_path_factory.mktemp("single")
    port = free_port()
    proc = Proc([sys.executable, "-m", "kvferry.engine.cli", "serve", "--model", "demo",
                 "--served-model-name", SERVICE_NAME, "--port", str(port), *MODEL_FLAGS],
                tmp / "single.log")
    proc.port = port  # type: ignore[attr-defined]
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, 240)
        yield proc
    finally:
        proc.stop()


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                         max_retries=0, timeout=60)


def answers(port: int) -> list[object]:
    c = client(port)
    out: list[object] = []
    for prompt in ("Hello", SHARED_PREFIX):
        done = c.completions.create(model=SERVICE_NAME, prompt=prompt, max_tokens=12,
                                    temperature=0)
        out.append((done.choices[0].text, done.usage.prompt_tokens, done.usage.completion_tokens))
        stream = c.completions.create(model=SERVICE_NAME, prompt=prompt, max_tokens=12,
                                      temperature=0, stream=True)
        out.append("".join(chunk.choices[0].text for chunk in stream if chunk.choices))
    chat = c.chat.completions.create(model=SERVICE_NAME, messages=MESSAGES, max_tokens=12,
                                     temperature=0)
    out.append(chat.choices[0].message.content)
    stream = c.chat.completions.create(model=SERVICE_NAME, messages=MESSAGES, max_tokens=12,
                                       temperature=0, stream=True)
    out.append("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices))
    return out


def test_up_answers_like_a_single_server(up: tuple[Proc, dict[str, str]], single: Proc) -> None:
    routed = answers(up[0].port)  # type: ignore[attr-defined]
    assert routed == answers(single.port)  # type: ignore[attr-defined]
    assert routed[0][0] and routed[1] == routed[0][0]  # the stream equals the whole answer


def test_bad_input_gets_the_engines_400(up: tuple[Proc, dict[str, str]], single: Proc) -> None:
    for body in ({"model": SERVICE_NAME, "prompt": "x", "max_tokens": -1},
                 {"model": SERVICE_NAME, "prompt": "x", "temperature": "hot"},
                 {"model": "other-model", "prompt": "x"}):
        via_router = httpx.post(f"http://127.0.0.1:{up[0].port}/v1/completions", json=body)  # type: ignore[attr-defined]
        direct = httpx.post(f"http://127.0.0.1:{single.port}/v1/completions", json=body)  # type: ignore[attr-defined]
        assert via_router.status_code == direct.status_code
        assert 400 <= direct.status_code < 500
        assert via_router.json()["error"] == direct.json()["error"]


def chosen(router_port: int) -> dict[str, float]:
    """pod -> times the prefix-aware policy chose it."""
    text = httpx.get(f"http://127.0.0.1:{router_port}/metrics").text
    found = re.findall(r'kvferry:router_pod_chosen_total\{pod="([^"]+)",policy="prefix-aware",'
                       r'pool="decode"\} (\S+)', text)
    return {pod: float(value) for pod, value in found}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {pod: after.get(pod, 0.0) - before.get(pod, 0.0) for pod in after}


def engine_waiting(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(re.search(r"^vllm:num_requests_waiting\{[^}]*\} (\S+)$", text, re.M).group(1))


def test_shared_prefix_lands_on_its_holder_until_it_is_busy(up: tuple[Proc, dict[str, str]]
                                                            ) -> None:
    port = up[0].port  # type: ignore[attr-defined]
    c = client(port)
    prefix = SHARED_PREFIX + " and the bridge"
    before = chosen(port)
    for i in range(4):  # one at a time: every one goes where the prefix is
        c.completions.create(model=SERVICE_NAME, prompt=f"{prefix} {i}", max_tokens=2)
    sequential = delta(before, chosen(port))
    (holder,) = [pod for pod, n in sequential.items() if n == 4]
    other = next(pod for pod in up[1] if pod != holder)
    # Skew: long requests sent to the holder directly queue in its engine (two run at once).
    direct = openai.OpenAI(base_url=up[1][holder] + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        load = [pool.submit(direct.completions.create, model=SERVICE_NAME, prompt="busy",
                            max_tokens=400, extra_body={"ignore_eos": True}) for _ in range(8)]
        deadline = time.monotonic() + 30
        while engine_waiting(up[1][holder]) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(1.0)  # a registry refresh (0.5 s) and a router poll (0.25 s)
        before = chosen(port)
        for i in range(3):
            c.completions.create(model=SERVICE_NAME, prompt=f"{prefix} busy {i}", max_tokens=2)
        skewed = delta(before, chosen(port))
        for future in load:
            future.result()
    assert skewed.get(other, 0) == 3 and skewed.get(holder, 0) == 0, skewed


def test_engines_publish_the_prompt_block_hashes_the_router_computes(
        up: tuple[Proc, dict[str, str]]) -> None:
    """The KV events in Redis hold exactly the engine's hashes of the prompt's full blocks,
    which the router computes itself from the prompt's token ids."""
    import redis

    proc, pods = up
    redis_url = re.search(r"registered as \S+ \(\S+\) in (redis://\S+)", proc.log()).group(1)
    prompt = "a river " * 40 + "unique tail"
    tokens = httpx.post(f"http://127.0.0.1:{proc.port}/tokenize",  # type: ignore[attr-defined]
                        json={"model": SERVICE_NAME, "prompt": prompt}).json()["tokens"]
    expected = prompt_block_hashes(tokens, 16)
    assert len(expected) == len(tokens) // 16 >= 2
    client(proc.port).completions.create(model=SERVICE_NAME, prompt=prompt, max_tokens=1)  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while True:
        entries = redis.Redis.from_url(redis_url).xrange(f"kvferry:{SERVICE_NAME}:kv_events")
        stored = {pod: set() for pod in pods}
        for _, fields in entries:
            stored[fields[b"pod"].decode()].update(split_hashes(fields[b"stored"]))
        holders = [pod for pod, hashes in stored.items() if set(expected) <= hashes]
        if holders:
            break
        assert time.monotonic() < deadline, "no pod published the prompt's blocks"
        time.sleep(0.1)
    metrics = httpx.get(f"http://127.0.0.1:{proc.port}/metrics").text  # type: ignore[attr-defined]
    applied = re.search(r"^kvferry:router_kv_event_batches (\S+)$", metrics, re.M).group(1)
    assert float(applied) >= 1


def test_a_client_leaving_a_stream_stops_the_generation(up: tuple[Proc, dict[str, str]]) -> None:
    proc, pods = up
    with httpx.stream("POST", f"http://127.0.0.1:{proc.port}/v1/completions", timeout=60,  # type: ignore[attr-defined]
                      json={"model": SERVICE_NAME, "prompt": "leaving early", "max_tokens": 900,
                            "ignore_eos": True, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    # 900 tokens would take seconds; the abort frees both pods at once.
    deadline = time.monotonic() + 3
    while any(engine_running(url) for url in pods.values()):
        assert time.monotonic() < deadline, "the engine kept generating for a gone client"
        time.sleep(0.05)


def engine_running(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M).group(1))

def child_with_port(parent: int, port: str) -> int:
    """The pid of `parent`'s child process whose command line has `--port <port>`."""
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    for pid in children:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--port" in argv and argv[argv.index(b"--port") + 1] == port.encode():
            return int(pid)
    raise AssertionError(f"no child of {parent} listens on {port}")


def test_up_restarts_a_dead_pod(up: tuple[Proc, dict[str, str]]) -> None:
    proc, pods = up
    name = f"{SERVICE_NAME}-decode-1"
    pid = child_with_port(proc.proc.pid, pods[name].rsplit(":", 1)[1])
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while f"[{name}] exited with" not in proc.log():
        assert time.monotonic() < deadline, proc.log()
        time.sleep(0.1)
    health_url = f"http://127.0.0.1:{proc.port}/health"  # type: ignore[attr-defined]
    # The key of the killed pod expires, then the restarted pod registers again.
    restarted_after = proc.log().count(f"registered as kvferry:{SERVICE_NAME}:pod:{name}")
    while proc.log().count(f"registered as kvferry:{SERVICE_NAME}:pod:{name}") == restarted_after:
        assert time.monotonic() < deadline, proc.log()
        time.sleep(0.2)
    while httpx.get(health_url).json()["pools"].get("decode") != sorted(pods):
        assert time.monotonic() < deadline, proc.log()
        time.sleep(0.05)
    done = client(proc.port).completions.create(model=SERVICE_NAME, prompt="Hello", max_tokens=3)  # type: ignore[attr-defined]
    assert done.choices[0].text



def test_each_local_pod_gets_its_own_kv_side_channel_port() -> None:
    from kvferry.operator.spec import parse_spec
    from kvferry.up import load_service, pod_children

    spec = parse_spec(load_service(None))
    env = {"KVFERRY_NIXL_PORT": "5600", "KVFERRY_SERVICE": spec.name}
    children = pod_children(spec, "redis://127.0.0.1:1", env)
    ports = [c.env["KVFERRY_NIXL_PORT"] for c in children]
    assert len(children) >= 2
    assert len(set(ports)) == len(ports) and "5600" not in ports
    assert {c.env["KVFERRY_POD_NAME"] for c in children} == {c.name for c in children}


def test_up_with_prefill_and_decode_pools_pulls_kv_and_answers_like_a_single_server(
    tmp_path: Path, single: Proc
) -> None:
    manifest = yaml.safe_load(service_yaml(tmp_path).read_text())
    manifest["spec"]["pools"] = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    manifest["spec"]["router"] = {"routing": {"decode": "least-loaded"}}
    path = tmp_path / "pd.yaml"
    path.write_text(yaml.safe_dump(manifest))
    port = free_port()
    proc = Proc([sys.executable, "-m", "kvferry.engine.cli", "up", "-f", str(path),
                 "--port", str(port)], tmp_path / "pd.log")
    try:
        deadline = time.monotonic() + 240
        while "ready: http" not in proc.log():
            assert proc.proc.poll() is None and time.monotonic() < deadline, proc.log()
            time.sleep(0.2)
        pods = dict(re.findall(r"pod (\S+): (http://127\.0\.0\.1:\d+)", proc.log()))
        # Long enough to pass the router's prefill threshold, so it takes both hops.
        prompt = " ".join(["the history of the river and the town"] * 40)
        got = client(port).completions.create(model=SERVICE_NAME, prompt=prompt, max_tokens=8,
                                              temperature=0)
        want = client(single.port).completions.create(  # type: ignore[attr-defined]
            model=SERVICE_NAME, prompt=prompt, max_tokens=8, temperature=0)
        assert got.choices[0].text == want.choices[0].text
        assert got.usage.completion_tokens == want.usage.completion_tokens
        router = httpx.get(f"http://127.0.0.1:{port}/metrics", trust_env=False).text
        assert 'kvferry:router_hop_requests_total{hop="prefill",outcome="200"} 1.0' in router
        decode = httpx.get(pods[f"{SERVICE_NAME}-decode-0"] + "/metrics", trust_env=False).text
        pulled = re.search(r'^kvferry:kv_transfer_bytes_total\{[^}]*\} (\S+)', decode, re.M)
        assert pulled is not None and float(pulled.group(1)) > 0, decode
    finally:
        assert proc.stop(timeout_s=60) == 0, proc.log()
