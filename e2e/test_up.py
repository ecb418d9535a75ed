"""`kvferry up` of real services (demo model): two engine pods with prefix-aware routing, and
one prefill with two decode pods. The official openai client through the router gets what a
single server gives, also while pods are killed under it."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import openai
import pytest
import yaml
from kvferry.engine.models.source import resolve_model_source
from kvferry.kvtransfer.metrics import FailureReason
from kvferry.router.config import RouterSettings
from kvferry.router.prefix_index import prompt_block_hashes
from kvferry_testing.procs import Proc, free_port, wait_http
from kvferry_testing.sockets import BoundSocket, listeners_of_tree, non_loopback, process_tree

from kvferry.protocol.kv_events import split_hashes

SERVICE_NAME = "uptest"
KV_BYTES = str(32 * 1024 * 1024)
MODEL_FLAGS = ["--max-model-len", "1024", "--kv-cache-memory-bytes", KV_BYTES,
               "--block-size", "16", "--dtype", "float32"]
# Words of the demo tokenizer's vocabulary, so a prompt's token count is predictable enough.
SHARED_PREFIX = " ".join(["the history of the river and the town"] * 24)
MESSAGES = [{"role": "user", "content": "Tell me about the river."}]
# The router key of the prefill/decode service (a Secret on a cluster, the environment here);
# clients send it to every router, and routers without a key ignore it.
API_KEY = "uptest-key"


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


def launch_up(tmp: Path, manifest: Path, pod_names: list[str],
              env: dict[str, str] | None = None) -> tuple[Proc, dict[str, str]]:
    """`kvferry up -f manifest`, once it says ready; returns it and pod name -> URL."""
    port = free_port()
    proc = Proc([sys.executable, "-m", "kvferry.cli", "up", "-f", str(manifest),
                 "--port", str(port)], tmp / "up.log", env=env)
    proc.port = port  # type: ignore[attr-defined]
    deadline = time.monotonic() + 240
    while "ready: http" not in proc.log():
        if proc.proc.poll() is not None or time.monotonic() > deadline:
            proc.stop()
            raise AssertionError(proc.log())
        time.sleep(0.2)
    pods = dict(re.findall(r"pod (\S+): (http://127\.0\.0\.1:\d+)", proc.log()))
    assert sorted(pods) == sorted(pod_names), proc.log()
    return proc, pods


def stop_up(proc: Proc) -> None:
    assert proc.stop(timeout_s=60) == 0, proc.log()
    assert "Traceback" not in proc.log(), proc.log()


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, dict[str, str]]]:
    """`kvferry up` of the service; yields it and pod name -> URL."""
    tmp = tmp_path_factory.mktemp("up")
    proc, pods = launch_up(tmp, service_yaml(tmp),
                           [f"{SERVICE_NAME}-decode-0", f"{SERVICE_NAME}-decode-1"])
    try:
        yield proc, pods
    finally:
        stop_up(proc)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """One colocated `kvferry serve`, the reference."""
    tmp = tmp_path_factory.mktemp("single")
    port = free_port()
    proc = Proc([sys.executable, "-m", "kvferry.cli", "serve", "--model", "demo",
                 "--served-model-name", SERVICE_NAME, "--port", str(port), *MODEL_FLAGS],
                tmp / "single.log")
    proc.port = port  # type: ignore[attr-defined]
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, 240)
        yield proc
    finally:
        proc.stop()


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY,
                         max_retries=0, timeout=60)


Usage = tuple[int, int, int]  # prompt, completion and total tokens


def usage_of(usage: object) -> Usage:
    return (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)  # type: ignore[attr-defined]


Query = str | list[dict[str, str]]  # a completion's prompt or a chat's messages


def create(c: openai.OpenAI, query: Query, stream: bool, max_tokens: int) -> object:
    """A greedy completion (for a prompt) or chat answer (for messages)."""
    kwargs: dict[str, object] = {"model": SERVICE_NAME, "max_tokens": max_tokens,
                                 "temperature": 0}
    if stream:
        kwargs.update(stream=True, stream_options={"include_usage": True})
    if isinstance(query, str):
        return c.completions.create(prompt=query, **kwargs)  # type: ignore[call-overload]
    return c.chat.completions.create(messages=query, **kwargs)  # type: ignore[call-overload]


def pieces(stream: object) -> Iterator[tuple[str, Usage | None]]:
    """A stream's text pieces, with the usage where a chunk has it."""
    for chunk in stream:  # type: ignore[attr-defined]
        text = ""
        if chunk.choices:
            choice = chunk.choices[0]
            text = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
        yield text, usage_of(chunk.usage) if chunk.usage else None


def ask(c: openai.OpenAI, query: Query, stream: bool, max_tokens: int = 12
        ) -> tuple[str, Usage]:
    """The answer's text and usage; streamed, the usage comes in the last chunk."""
    answer = create(c, query, stream, max_tokens)
    if not stream:
        choice = answer.choices[0]  # type: ignore[attr-defined]
        text = choice.text if hasattr(choice, "text") else choice.message.content
        return text, usage_of(answer.usage)  # type: ignore[attr-defined]
    got = list(pieces(answer))
    return "".join(text for text, _ in got), got[-1][1]  # type: ignore[return-value]


def answers(port: int, prompts: tuple[str, ...] = ("Hello", SHARED_PREFIX),
            chats: tuple[list[dict[str, str]], ...] = (MESSAGES,)) -> list[tuple[str, Usage]]:
    """Each prompt completed and each chat answered, whole then streamed (in pairs)."""
    c = client(port)
    out = []
    for prompt in prompts:
        out += [ask(c, prompt, stream=False), ask(c, prompt, stream=True)]
    for messages in chats:
        out += [ask(c, messages, stream=False), ask(c, messages, stream=True)]
    return out


def test_up_answers_like_a_single_server(up: tuple[Proc, dict[str, str]], single: Proc) -> None:
    routed = answers(up[0].port)  # type: ignore[attr-defined]
    assert routed == answers(single.port)  # type: ignore[attr-defined]
    assert all(text for text, _ in routed)
    assert routed[0::2] == routed[1::2]  # each stream equals the whole answer


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
    # `kvferry up` hands the router the demo's tokenizer: a text prompt costs no /tokenize.
    assert tokenized(metrics, "router") >= 1
    before = {where: tokenized(metrics, where) for where in ("router", "pod")}
    client(proc.port).completions.create(model=SERVICE_NAME, prompt=prompt, max_tokens=1)  # type: ignore[attr-defined]
    after = httpx.get(f"http://127.0.0.1:{proc.port}/metrics").text  # type: ignore[attr-defined]
    assert (tokenized(after, "router"), tokenized(after, "pod")) == (
        before["router"] + 1, before["pod"])


def tokenized(metrics: str, where: str) -> float:
    found = re.search(rf'^kvferry:router_tokenized_prompts_total\{{where="{where}"\}} (\S+)$',
                      metrics, re.M)
    return float(found.group(1)) if found else 0.0


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


def test_every_local_pod_gets_the_runs_transfer_key_and_each_run_its_own() -> None:
    from kvferry.kvtransfer.auth import KEY_ENV, MIN_KEY_BYTES
    from kvferry.operator.spec import parse_spec

    from kvferry.up import load_service, pod_children, router_child, transfer_key_text

    spec = parse_spec(load_service(None))
    first, second = transfer_key_text({}), transfer_key_text({})
    assert first != second and len(first.encode()) >= MIN_KEY_BYTES
    children = pod_children(spec, "redis://127.0.0.1:1", {}, first)
    assert {c.env[KEY_ENV] for c in children} == {first}
    # The router checks the pods' registry records and KV events with the same key.
    router = router_child(spec, "redis://127.0.0.1:1", "127.0.0.1", 8000, {}, first)
    assert router.env[KEY_ENV] == first
    # A key given to `kvferry up` is the pods' (a pod started by hand can join them).
    given = "a-transfer-key-shared-with-other-pods-0123"
    assert transfer_key_text({KEY_ENV: given}) == given
    with pytest.raises(ValueError, match=f"{KEY_ENV}: a KV transfer key needs at least 32"):
        transfer_key_text({KEY_ENV: "short"})


def test_up_with_a_short_transfer_key_says_so_before_starting_anything(tmp_path: Path) -> None:
    from kvferry.kvtransfer.auth import KEY_ENV

    done = subprocess.run([sys.executable, "-m", "kvferry.cli", "up", "--port",
                           str(free_port())], capture_output=True, text=True, timeout=60,
                          env={**os.environ, KEY_ENV: "short-key"})
    assert done.returncode == 2
    assert f"kvferry up: error: ${KEY_ENV}: a KV transfer key needs at least 32 bytes, this " \
           "one has 9" in done.stderr
    assert "short-key" not in done.stderr


def test_the_router_and_pods_get_their_drain_before_sigkill(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """`kvferry up` stops the router (then the pods) with SIGTERM and waits longer than the
    drain they read from the service's environment before it kills them."""
    from kvferry.operator.render import render_config_map
    from kvferry.operator.spec import parse_spec

    from kvferry.cli import build_parser
    from kvferry.up import load_service, pod_children, router_child, transfer_key_text

    manifest = load_service(None)
    manifest["spec"]["engine"]["drainSeconds"] = 45
    spec = parse_spec(manifest)
    env = dict(render_config_map(spec)["data"])
    router = router_child(spec, "redis://127.0.0.1:1", "127.0.0.1", 8000, env,
                          transfer_key_text({}))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = router.args[3:]
    drain = build_parser(argv).parse_args(argv).drain_timeout
    assert drain == 45
    assert router.stop_timeout_s > drain
    assert all(pod.stop_timeout_s > drain for pod in pod_children(spec, "redis://x:1", env))


# ---------------------------------------------------------------------- prefill and decode pools
PD_PODS = [f"{SERVICE_NAME}-prefill-0", f"{SERVICE_NAME}-decode-0", f"{SERVICE_NAME}-decode-1"]
LONG_MESSAGES = [{"role": "user", "content": SHARED_PREFIX}]
PREFILL_THRESHOLD = RouterSettings.prefill_threshold_tokens


def pd_yaml(tmp: Path) -> Path:
    """The service with one prefill and two decode pods, on a Redis whose URL a Secret holds,
    behind a router whose API key a Secret holds."""
    manifest = yaml.safe_load(service_yaml(tmp).read_text())
    manifest["spec"]["pools"] = {"prefill": {"replicas": 1}, "decode": {"replicas": 2}}
    # Round robin: the router sends each decode pod its share, whatever their loads.
    manifest["spec"]["router"] = {"routing": {"decode": "round-robin"},
                                  "apiKeySecret": {"name": "router-keys", "key": "key"}}
    manifest["spec"]["redis"] = {"urlSecret": {"name": "shared-redis", "key": "url"}}
    path = tmp / "pd.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory, redis_url: str
       ) -> Iterator[tuple[Proc, dict[str, str]]]:
    """`kvferry up` of the prefill/decode service; the test's Redis stands for the Secret's."""
    tmp = tmp_path_factory.mktemp("pd")
    proc, pods = launch_up(tmp, pd_yaml(tmp), PD_PODS,
                           env={"KVFERRY_REDIS_URL": redis_url, "KVFERRY_API_KEY": API_KEY})
    try:
        yield proc, pods
    finally:
        stop_up(proc)


def test_up_takes_a_url_secrets_redis_from_the_environment(
        pd: tuple[Proc, dict[str, str]], redis_url: str) -> None:
    import redis

    proc, _ = pd
    store = redis.Redis.from_url(redis_url)
    keys = sorted(k.decode() for k in store.scan_iter(f"kvferry:{SERVICE_NAME}:pod:*"))
    assert keys == [f"kvferry:{SERVICE_NAME}:pod:{name}" for name in sorted(PD_PODS)]
    assert "[redis]" not in proc.log()  # no Redis of its own


def test_up_takes_the_routers_api_key_secret_from_the_environment(
        pd: tuple[Proc, dict[str, str]]) -> None:
    proc, pods = pd
    body = {"model": SERVICE_NAME, "prompt": "Hello", "max_tokens": 2}
    url = f"http://127.0.0.1:{proc.port}/v1/completions"  # type: ignore[attr-defined]
    refused = httpx.post(url, json=body, timeout=60, trust_env=False)
    assert refused.status_code == 401, refused.text
    wrong = httpx.post(url, json=body, timeout=60, trust_env=False,
                       headers={"Authorization": "Bearer not-the-key"})
    assert wrong.status_code == 401, wrong.text
    served = httpx.post(url, json=body, timeout=60, trust_env=False,
                        headers={"Authorization": f"Bearer {API_KEY}"})
    assert served.status_code == 200, served.text
    # The key is the router's: the pods behind it take requests without one, as on a cluster.
    pod = httpx.post(pods[PD_PODS[-1]] + "/v1/completions", json=body, timeout=60,
                     trust_env=False)
    assert pod.status_code == 200, pod.text


def test_up_with_an_api_key_secret_and_no_key_says_how_to_run_it(tmp_path: Path,
                                                                  redis_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVFERRY_API_KEY"}
    env["KVFERRY_REDIS_URL"] = redis_url
    done = subprocess.run([sys.executable, "-m", "kvferry.cli", "up", "-f",
                           str(pd_yaml(tmp_path)), "--port", str(free_port())],
                          check=False, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done
    assert done.stdout == "" and "Traceback" not in done.stderr, done
    assert done.stderr == (
        "kvferry up: error: spec.router.apiKeySecret names key 'key' of Secret 'router-keys', "
        "which a local run cannot read: set KVFERRY_API_KEY to that API key, or drop "
        "spec.router.apiKeySecret to serve without a key\n")


def test_up_on_a_port_in_use_says_so_before_starting_anything(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "kvferry.cli", "up", "-f",
                               str(service_yaml(tmp_path)), "--port", str(port)],
                              check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done
    assert done.stdout == "" and "Traceback" not in done.stderr, done
    assert done.stderr.startswith(f"kvferry up: error: cannot listen on 127.0.0.1:{port} ("), done
    assert done.stderr.endswith(
        "another process holds it; stop it or choose another --port\n"), done
    assert "pod " not in done.stderr, done  # nothing was started


def test_up_with_a_url_secret_and_no_redis_url_says_how_to_run_it(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVFERRY_REDIS_URL"}
    done = subprocess.run([sys.executable, "-m", "kvferry.cli", "up", "-f",
                           str(pd_yaml(tmp_path)), "--port", str(free_port())],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done
    assert done.stdout == "" and "Traceback" not in done.stderr, done
    assert done.stderr == (
        "kvferry up: error: spec.redis.urlSecret names key 'url' of Secret 'shared-redis', "
        "which a local run cannot read: set KVFERRY_REDIS_URL to that Redis URL, or give the "
        "URL as spec.redis.url\n")


# ------------------------------------------------------------------------------- failing fast
def run_up(manifest: dict, tmp: Path, env: dict[str, str] | None = None, timeout_s: float = 120
           ) -> tuple[subprocess.CompletedProcess[str], float]:
    """`kvferry up -f` of `manifest` to its end; the result and how long it took."""
    path = tmp / "service.yaml"
    path.write_text(yaml.safe_dump(manifest))
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "kvferry.cli", "up", "-f", str(path),
                           "--port", str(free_port())], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, **(env or {})})
    return done, time.monotonic() - began


def manifest_with(model: dict, engine: dict | None = None) -> dict:
    return {"apiVersion": "kvferry.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "failing"},
            "spec": {"model": model, "engine": engine or {}, "pools": {"decode": {"replicas": 1}}}}


SOURCE_FIX = ("spec.model.source must name a checkpoint the engine can load: hostpath:///DIR "
              "for an HF checkpoint directory on this machine (config.json of a supported "
              "architecture, *.safetensors, tokenizer.json), hf://ORG/NAME where the hub is "
              "reachable, or demo")


def test_up_with_a_missing_model_path_exits_within_10_s_with_one_error(tmp_path: Path) -> None:
    done, elapsed = run_up(manifest_with({"source": "hostpath:///nonexistent/model"}), tmp_path)
    assert done.returncode == 2, done
    assert elapsed < 10, elapsed
    assert done.stdout == "", done
    assert done.stderr == ("kvferry up: error: spec.model.source hostpath:///nonexistent/model: "
                           f"/nonexistent/model does not exist. {SOURCE_FIX}\n")


def test_up_with_a_model_the_engine_cannot_run_says_so_before_starting_anything(
        tmp_path: Path) -> None:
    from kvferry.engine.models import SUPPORTED_ARCHITECTURES

    model = tmp_path / "t5"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["T5ForConditionalGeneration"], "num_attention_heads": 4,
        "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "vocab_size": 256}))
    done, elapsed = run_up(manifest_with({"source": f"hostpath://{model}"}), tmp_path)
    assert (done.returncode, done.stdout) == (2, ""), done
    assert done.stderr == (
        f"kvferry up: error: spec.model.source hostpath://{model}: {model}/config.json names the "
        "architecture 'T5ForConditionalGeneration', which the engine does not implement; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}. {SOURCE_FIX}\n")
    assert elapsed < 10, elapsed


def test_a_tokenizer_given_in_the_extra_flags_is_the_pods_and_the_routers(tmp_path: Path) -> None:
    from kvferry.operator.spec import parse_spec

    from kvferry.up import check_model_source, pod_children, router_child

    model = tmp_path / "weights-only"
    shutil.copytree(Path(resolve_model_source("demo")), model)
    (model / "tokenizer.json").unlink()
    manifest = manifest_with({"source": f"hostpath://{model}"},
                             {"extraArgs": ["--tokenizer", "demo"]})
    spec = parse_spec(manifest)
    assert check_model_source(spec) == str(model)
    (pod,) = pod_children(spec, "redis://127.0.0.1:1", {}, model=str(model))
    assert pod.args[pod.args.index("--model") + 1] == str(model)
    assert pod.args[-2:] == ["--tokenizer", "demo"]
    router = router_child(spec, "redis://127.0.0.1:1", "127.0.0.1", 8000, {}, "k" * 32,
                          str(model))
    assert router.args[router.args.index("--tokenizer") + 1] == "demo"
    # Without it the checkpoint lacks what the pods need, and says so.
    with pytest.raises(ValueError, match=f"{model} has no tokenizer.json"):
        check_model_source(parse_spec(manifest_with({"source": f"hostpath://{model}"})))


def test_up_with_a_hub_model_it_cannot_download_says_so_before_starting_anything(
        tmp_path: Path) -> None:
    done, elapsed = run_up(manifest_with({"source": "hf://org/model"}), tmp_path,
                           env={"HF_HUB_OFFLINE": "1"})
    assert (done.returncode, done.stdout) == (2, ""), done
    assert done.stderr.splitlines()[-1] == (
        "kvferry up: error: spec.model.source hf://org/model: cannot download 'org/model': "
        f"HF_HUB_OFFLINE is set. {SOURCE_FIX}")
    assert elapsed < 10, elapsed


def test_up_of_the_whisper_example_without_the_hub_fails_at_once(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "whisper.yaml"
    done, elapsed = run_up(yaml.safe_load(example.read_text()), tmp_path,
                           env={"HF_HUB_OFFLINE": "1", "KVFERRY_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert (done.returncode, done.stdout) == (2, ""), done
    assert done.stderr.count("\n") == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        "kvferry up: error: spec.model.source hf://openai/whisper-large-v3: cannot download "
        "'openai/whisper-large-v3': HF_HUB_OFFLINE is set."), done.stderr
    assert elapsed < 10, elapsed


def test_a_pod_that_crashes_before_it_is_ready_ends_up_within_30_s(tmp_path: Path) -> None:
    manifest = manifest_with({"source": "demo", "maxModelLen": 512},
                             {"extraArgs": ["--max-stop-strings", "0"]})
    done, elapsed = run_up(manifest, tmp_path)
    assert done.returncode == 1, done
    assert elapsed < 30, (elapsed, done)
    refusal = "kvferry serve: --max-stop-strings must be >= 1, got 0"
    # Started three times, with backoff between, then the whole run stops.
    assert done.stdout.count(f"[failing-decode-0] {refusal}\n") == 3, done.stdout
    assert "[failing-decode-0] exited with 2 before it was ever ready (1 of 3); restarting " \
           "in 1 s" in done.stdout
    assert "[failing-decode-0] exited with 2 before it was ever ready (2 of 3); restarting " \
           "in 2 s" in done.stdout
    assert done.stderr.count("kvferry up: error: ") == 1, done.stderr
    assert done.stderr.endswith(
        "kvferry up: error: failing-decode-0 exited 3 times in a row before it was ready (last "
        f"exit status 2); its last lines:\n  {refusal}\n"), done.stderr
    assert "Traceback" not in done.stdout


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` in `url`/metrics whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(url + "/metrics", trust_env=False).text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample.split("{")[0] == name and all(f'{k}="{v}"' in sample
                                                  for k, v in labels.items()):
            total += float(value)
    return total


def pd_counts(proc: Proc, pods: dict[str, str]) -> dict[str, float]:
    """What the router counted of the prefill hop, and what the decode pods pulled."""
    router = f"http://127.0.0.1:{proc.port}"  # type: ignore[attr-defined]
    decodes = [url for name, url in pods.items() if "-decode-" in name]
    return {
        "prefill_hops": metric(router, "kvferry:router_hop_requests_total", hop="prefill",
                               outcome="200"),
        "short_skips": metric(router, "kvferry:router_prefill_skips_total",
                              reason="short_prompt"),
        "cached_skips": metric(router, "kvferry:router_prefill_skips_total",
                               reason="cached_on_decode"),
        "fallbacks": metric(router, "kvferry:router_prefill_fallbacks_total"),
        "pulled_bytes": sum(metric(u, "kvferry:kv_transfer_bytes_total") for u in decodes),
        "pull_failures": sum(metric(u, "kvferry:kv_transfer_failures_total") for u in decodes),
        **{f"failed_{reason}": sum(metric(u, "kvferry:kv_transfer_failures_total",
                                          reason=reason) for u in decodes)
           for reason in FailureReason},
    }


def grown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before[key] for key in after}


def test_prefill_and_decode_pools_answer_like_a_single_server_and_pull_the_kv(
        pd: tuple[Proc, dict[str, str]], single: Proc) -> None:
    proc, pods = pd
    before = pd_counts(proc, pods)
    kinds = {"prompts": ("Hello", SHARED_PREFIX), "chats": (MESSAGES, LONG_MESSAGES)}
    routed = answers(proc.port, **kinds)  # type: ignore[attr-defined, arg-type]
    counted = grown(before, pd_counts(proc, pods))
    assert routed == answers(single.port, **kinds)  # type: ignore[attr-defined, arg-type]
    assert all(text for text, _ in routed) and routed[0::2] == routed[1::2]
    # In pairs (whole, streamed): short completion, long completion, short chat, long chat.
    prompt_tokens = [usage[0] for _, usage in routed]
    short, long = prompt_tokens[0:2] + prompt_tokens[4:6], prompt_tokens[2:4] + prompt_tokens[6:8]
    assert max(short) < PREFILL_THRESHOLD < min(long), prompt_tokens
    assert counted["short_skips"] == len(short), counted
    # Each long prompt goes twice; the second time its decode pod may hold it already.
    assert counted["prefill_hops"] + counted["cached_skips"] == len(long), counted
    assert counted["prefill_hops"] >= len(long) / 2, counted
    assert counted["fallbacks"] == 0 and counted["pull_failures"] == 0, counted
    assert counted["pulled_bytes"] > 0, counted


# The burst's long prompts share this beginning, which no other test sends (a decode pod
# that holds a prompt's blocks gets it without a prefill hop, and other tests count those).
BURST_PREFIX = " ".join(["a river town had an old stone mill by the bridge"] * 24)
BURST_WORDS = ("river", "town", "mill", "bridge", "stone", "history", "old", "came", "back",
               "went")


def burst_prompt(index: int) -> str:
    """BURST_PREFIX, then words of its own (index's digits): 1,000 different prompts."""
    return BURST_PREFIX + " " + " ".join(BURST_WORDS[int(digit)] for digit in f"{index:03d}")


def test_a_burst_of_1000_requests_through_prefill_and_decode_gets_no_503(
        pd: tuple[Proc, dict[str, str]]) -> None:
    """A thousand long prompts at once, each on a connection of its own: every pod stays in
    the router's pools throughout (their loops are busy, their records are refreshed all
    the same), and every request is answered, none by a prefill fallback: through the
    prefill pod, or by a decode pod that holds all but the prompt's short tail already."""
    proc, pods = pd
    router = f"http://127.0.0.1:{proc.port}"  # type: ignore[attr-defined]
    everyone = {"decode": PD_PODS[1:], "prefill": PD_PODS[:1]}
    before = pd_counts(proc, pods)
    seen: list[dict[str, list[str]]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.1):
            seen.append(httpx.get(router + "/health", trust_env=False).json()["pools"])

    async def burst() -> dict[object, int]:
        connector = aiohttp.TCPConnector(limit=0)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with aiohttp.ClientSession(connector=connector, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=120)) as session:
            async def one(index: int) -> object:
                body = {"model": SERVICE_NAME, "prompt": burst_prompt(index), "max_tokens": 2}
                try:
                    async with session.post(router + "/v1/completions", json=body) as r:
                        await r.read()
                        return r.status
                except (aiohttp.ClientError, TimeoutError) as exc:
                    return type(exc).__name__

            return dict(collections.Counter(await asyncio.gather(*map(one, range(1000)))))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        statuses = asyncio.run(burst())
    finally:
        done.set()
        watcher.join()
    assert statuses == {200: 1000}
    assert seen and all(pools == everyone for pools in seen), [p for p in seen if p != everyone]
    counts = grown(before, pd_counts(proc, pods))
    assert counts["prefill_hops"] + counts["cached_skips"] == 1000, counts
    # How many go each way depends on how fast the decode pods' blocks become known.
    assert counts["prefill_hops"] > 0 and counts["fallbacks"] == 0, counts
    failed = [line for line in proc.log().splitlines() if "KV pull for" in line]
    assert counts["pull_failures"] == 0, ({k: v for k, v in counts.items() if v}, failed[:5])
    assert metric(router, "kvferry:router_pods_dropped_total") == 0


def test_a_pipeline_parallel_prefill_and_decode_service_answers_like_a_single_server(
        tmp_path: Path, single: Proc) -> None:
    """Prefill and decode pods of two pipeline stages each: the decode pod pulls each
    stage's blocks from the prefill pod's same stage (every worker's own NIXL agent)."""
    manifest = yaml.safe_load(service_yaml(tmp_path).read_text())
    manifest["spec"]["engine"]["pipelineParallelSize"] = 2
    manifest["spec"]["pools"] = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(manifest))
    names = [f"{SERVICE_NAME}-prefill-0", f"{SERVICE_NAME}-decode-0"]
    proc, pods = launch_up(tmp_path, path, names)
    try:
        before = pd_counts(proc, pods)
        prompts = ("Hello", SHARED_PREFIX)
        routed = answers(proc.port, prompts, chats=())  # type: ignore[attr-defined]
        assert routed == answers(single.port, prompts, chats=())  # type: ignore[attr-defined]
        counted = grown(before, pd_counts(proc, pods))
        assert counted["prefill_hops"] >= 1 and counted["fallbacks"] == 0, counted
        assert counted["pull_failures"] == 0 and counted["pulled_bytes"] > 0, counted
        decode_log = [line for line in proc.log().splitlines()
                      if line.startswith(f"[{names[1]}]") and "pp-stage-" in line]
        assert decode_log, "the decode pod runs no pipeline stages"
    finally:
        stop_up(proc)


def child_port(url: str) -> str:
    return url.rsplit(":", 1)[1]


# A long prompt that shares no prefix block with the other tests' prompts.
FRESH_LONG_PROMPT = " ".join(["the town and the river of the history"] * 24)


def engine_cores(root: int) -> list[int]:
    """The engine-core processes under `root` (each pod's child)."""
    cores = []
    for pid in process_tree(root):
        with contextlib.suppress(OSError):
            if b"core_process" in Path(f"/proc/{pid}/cmdline").read_bytes():
                cores.append(pid)
    return cores


def assert_loopback_only(proc: Proc, pods: dict[str, str]) -> list[BoundSocket]:
    """Every listener of every process `kvferry up` runs is on loopback, and the socket
    table read shows each of them: the router's and each pod's HTTP port, and in each engine
    core its KV side channel and UCX's listeners."""
    listeners = listeners_of_tree(proc.proc.pid)
    assert non_loopback(listeners) == []
    ports = {s.port for s in listeners}
    assert proc.port in ports, listeners  # type: ignore[attr-defined]
    assert all(int(child_port(url)) in ports for url in pods.values()), listeners
    cores = engine_cores(proc.proc.pid)
    assert len(cores) == len(pods), cores
    for pid in cores:
        assert len([s for s in listeners if s.pid == pid]) >= 2, (pid, listeners)
    return listeners


def test_every_process_of_a_local_service_listens_on_loopback_only(
        up: tuple[Proc, dict[str, str]]) -> None:
    listeners = assert_loopback_only(*up)
    # Its own Redis, too.
    redis_url = re.search(r"registered as \S+ \(\S+\) in (redis://\S+)", up[0].log()).group(1)
    assert urllib.parse.urlsplit(redis_url).port in {s.port for s in listeners}, listeners


def test_prefill_and_decode_pods_listen_on_loopback_only_after_a_pull(
        pd: tuple[Proc, dict[str, str]]) -> None:
    proc, pods = pd
    before = pd_counts(proc, pods)
    # Through prefill then decode: UCX has connected and read in two engine cores.
    assert ask(client(proc.port), FRESH_LONG_PROMPT, stream=False)[0]  # type: ignore[attr-defined]
    counted = grown(before, pd_counts(proc, pods))
    assert counted["prefill_hops"] == 1 and counted["pulled_bytes"] > 0, counted
    assert_loopback_only(proc, pods)


def kill_pod(proc: Proc, pods: dict[str, str], name: str) -> int:
    """SIGKILLs the pod's server (no goodbye to the registry) and waits until its port refuses
    connections; returns how many times it had registered, to wait for its comeback."""
    registered = proc.log().count(f"registered as kvferry:{SERVICE_NAME}:pod:{name}")
    os.killpg(child_with_port(proc.proc.pid, child_port(pods[name])), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", int(child_port(pods[name]))), 1.0).close()
        except ConnectionRefusedError:
            return registered
        assert time.monotonic() < deadline, f"{name} still takes connections"
        time.sleep(0.02)


def wait_back(proc: Proc, name: str, registered: int, pools: dict[str, list[str]]) -> None:
    """Until the restarted pod registered again and the router lists `pools`."""
    deadline = time.monotonic() + 120
    while proc.log().count(f"registered as kvferry:{SERVICE_NAME}:pod:{name}") == registered:
        assert time.monotonic() < deadline, proc.log()
        time.sleep(0.1)
    health = f"http://127.0.0.1:{proc.port}/health"  # type: ignore[attr-defined]
    while httpx.get(health, trust_env=False).json()["pools"] != pools:
        assert time.monotonic() < deadline, proc.log()
        time.sleep(0.05)


# Long prompts no other test sends: a decode pod that decoded one holds it, and the router
# then skips the prefill hop for it (cached_on_decode), which these tests count.
MILL_PROMPT = " ".join(["the prefill pod went down by the old mill"] * 24)
BRIDGE_PROMPT = " ".join(["and came back up by the stone bridge"] * 24)


def long_answers(c: openai.OpenAI, prompt: str = SHARED_PREFIX) -> list[tuple[str, Usage]]:
    """The long prompt completed and chatted, whole and streamed, all at once."""
    messages = [{"role": "user", "content": prompt}]
    calls = [(prompt, False), (prompt, True), (messages, False), (messages, True)]
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(ask, c, query, stream) for query, stream in calls]
        return [future.result() for future in futures]


def test_long_prompts_decode_without_the_killed_prefill_pod_and_use_it_once_back(
        pd: tuple[Proc, dict[str, str]], single: Proc) -> None:
    proc, pods = pd
    name = f"{SERVICE_NAME}-prefill-0"
    want = long_answers(client(single.port), MILL_PROMPT)  # type: ignore[attr-defined]
    before = pd_counts(proc, pods)
    registered = kill_pod(proc, pods, name)
    # `kvferry up` starts it again a second after it exits, and it loads for seconds before
    # it registers: these meet either the dead pod (its key lives on for a TTL) or none.
    got = long_answers(client(proc.port), MILL_PROMPT)  # type: ignore[attr-defined]
    down = pd_counts(proc, pods)
    assert got == want
    # Each request falls back, or (sent after a twin's decode hop began) finds its decode
    # pod holding the prompt and skips the hop.
    changed = grown(before, down)
    assert changed["fallbacks"] + changed["cached_skips"] == len(want), changed
    assert down["prefill_hops"] == before["prefill_hops"]

    wait_back(proc, name, registered, {"decode": PD_PODS[1:], "prefill": [name]})
    expected = ask(client(single.port), BRIDGE_PROMPT, stream=False)  # type: ignore[attr-defined]
    assert ask(client(proc.port), BRIDGE_PROMPT, stream=False) == expected  # type: ignore[attr-defined]
    back = grown(down, pd_counts(proc, pods))
    assert back["prefill_hops"] == 1 and back["fallbacks"] == 0, back
    assert back["pulled_bytes"] > 0 and back["pull_failures"] == 0, back


def outcome(c: openai.OpenAI, query: Query, stream: bool, max_tokens: int
            ) -> tuple[str, Usage | None, bool]:
    """(text, usage, failed): a stream cut by a dying pod ends in an error event, which
    the client raises after the text it got so far."""
    if not stream:
        return (*ask(c, query, stream, max_tokens), False)
    text, usage = "", None
    try:
        for piece, piece_usage in pieces(create(c, query, stream, max_tokens)):
            text, usage = text + piece, piece_usage or usage
    except openai.APIError:
        return text, usage, True
    return text, usage, False


def busy(url: str) -> None:
    """A long request sent to a pod directly; it ends with the pod."""
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(url + "/v1/completions", timeout=120, trust_env=False, json={
            "model": SERVICE_NAME, "prompt": "busy", "max_tokens": 400, "ignore_eos": True})


def test_a_decode_pod_killed_under_running_requests_costs_only_the_streams_it_had_begun(
        pd: tuple[Proc, dict[str, str]], single: Proc) -> None:
    proc, pods = pd
    victim = pods[f"{SERVICE_NAME}-decode-1"]
    router = f"http://127.0.0.1:{proc.port}"  # type: ignore[attr-defined]
    max_tokens = 24
    queries: list[Query] = ["Hello", SHARED_PREFIX, MESSAGES, LONG_MESSAGES]
    want = [ask(client(single.port), q, False, max_tokens) for q in queries]  # type: ignore[attr-defined]
    calls = [(i, stream) for stream in (True, False, True) for i in range(len(queries))]
    retries = metric(router, "kvferry:router_retries_total", hop="decode")
    stream_errors = metric(router, "kvferry:router_stream_errors_total")
    c = client(proc.port)  # type: ignore[attr-defined]
    with concurrent.futures.ThreadPoolExecutor(len(calls) + 2) as pool:
        # Two long requests fill the pod's two running slots, so what the router sends it
        # waits in its queue (the pod has taken them: a stream has its headers already).
        load = [pool.submit(busy, victim) for _ in range(2)]
        deadline = time.monotonic() + 30
        while engine_running(victim) < 2:
            assert time.monotonic() < deadline, "the pod never ran the long requests"
            time.sleep(0.01)
        futures = [pool.submit(outcome, c, queries[i], stream, max_tokens)
                   for i, stream in calls]
        while engine_waiting(victim) < 1:
            if all(f.done() for f in futures):
                pools = httpx.get(router + "/health", trust_env=False).json()["pools"]
                pytest.fail(f"the router sent the pod nothing: its pools {pools}, the pod "
                            f"running {engine_running(victim)}, answers "
                            f"{[f.result()[2] for f in futures]}")
            time.sleep(0.01)
        kill_pod(proc, pods, f"{SERVICE_NAME}-decode-1")
        got = [future.result() for future in futures]  # each within the client's timeout
        for future in load:
            future.result()
    failed = [n for n, (_, _, is_failed) in enumerate(got) if is_failed]
    for n, ((i, stream), (text, usage, is_failed)) in enumerate(zip(calls, got, strict=True)):
        if is_failed:  # only a stream that the killed pod had begun to answer
            assert stream and text and want[i][0].startswith(text), (calls[n], got[n])
        else:
            assert (text, usage) == want[i], (calls[n], got[n])
    assert metric(router, "kvferry:router_stream_errors_total") - stream_errors == len(failed)
    # What waited on the killed pod went on to the other one.
    assert metric(router, "kvferry:router_retries_total", hop="decode") - retries >= 1
    # New requests go to the live pod (the dead one is refused, then set aside or gone).
    for i, query in enumerate(queries):
        assert ask(c, query, stream=True, max_tokens=max_tokens) == want[i]
