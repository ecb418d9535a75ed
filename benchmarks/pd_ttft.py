"""Time to first token through prefill-then-decode against one colocated server.

Starts three `kvferry serve` processes on 127.0.0.1 (a prefill pod, a decode pod and a
colocated one) on the demo model and sends each `--num-prompts` distinct prompts of
`--prompt-tokens` random token ids (no prefix hits anywhere). Colocated TTFT is the time
to the first streamed token; disaggregated TTFT is the prefill hop (max_tokens 1) plus the
decode hop's time to its first streamed token, which includes the NIXL pull. The share of
it spent in the transfer comes from the decode pod's `kvferry:kv_transfer_seconds`.
The last line is one JSON object.

    python benchmarks/pd_ttft.py [--prompt-tokens 2000] [--num-prompts 5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from kvferry.kvtransfer.auth import KEY_ENV, generate_key_text
from serving import wait_ready

VOCAB = 2048  # the demo model's
RUN_KEY = generate_key_text()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, role: str, log_dir: Path) -> None:
        self.port = free_port()
        self.log = open(log_dir / f"{role}.log", "wb")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "kvferry.cli", "serve", "--model", "demo",
               "--served-model-name", "demo", "--host", "127.0.0.1", "--port", str(self.port),
               "--role", role, "--max-model-len", "4096"]
        # The pods share one KV transfer key, as a service's pods do.
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, KEY_ENV: RUN_KEY})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        wait_ready(self.url, self.proc, timeout_s)

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rpartition(" ")[2])
        raise KeyError(name)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.log.close()


def first_token_seconds(server: Server, prompt: list[int], max_tokens: int,
                        kv_transfer_params: dict[str, Any] | None = None) -> float:
    """Seconds from sending to the first streamed token."""
    body: dict[str, Any] = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0.0, "ignore_eos": True, "stream": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    start = time.perf_counter()
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError("no token streamed")


def prefill(server: Server, prompt: list[int]) -> tuple[float, dict[str, Any]]:
    body = {"model": "demo", "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
            "ignore_eos": True, "kv_transfer_params": {"do_remote_decode": True}}
    start = time.perf_counter()
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return time.perf_counter() - start, r.json()["kv_transfer_params"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--num-prompts", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(args.prompt_tokens)]
               for _ in range(2 * args.num_prompts + 1)]
    with tempfile.TemporaryDirectory() as log_dir:
        servers = {role: Server(role, Path(log_dir)) for role in ("prefill", "decode", "both")}
        try:
            for server in servers.values():
                server.wait_ready()
            result = measure(servers, prompts, args.num_prompts)
        finally:
            for server in servers.values():
                server.stop()
    print(f"colocated TTFT {result['colocated_ttft_s'] * 1e3:.1f} ms, prefill-then-decode "
          f"{result['pd_ttft_s'] * 1e3:.1f} ms (prefill hop {result['prefill_hop_s'] * 1e3:.1f} "
          f"ms, pull {result['pull_s'] * 1e3:.2f} ms = {result['transfer_share'] * 100:.1f}%)")
    print(json.dumps(result))


def measure(servers: dict[str, Server], prompts: list[list[int]], n: int) -> dict[str, Any]:
    # One warm-up through each path (first-call allocations, the handshake).
    first_token_seconds(servers["both"], prompts[-1], 1)
    _, params = prefill(servers["prefill"], prompts[-1])
    first_token_seconds(servers["decode"], prompts[-1], 2, params)
    colocated = [first_token_seconds(servers["both"], p, 1) for p in prompts[:n]]
    prefill_hops, decode_hops, pulls = [], [], []
    for prompt in prompts[n:2 * n]:
        seconds, params = prefill(servers["prefill"], prompt)
        pulled_before = servers["decode"].metric("kvferry:kv_transfer_seconds_sum")
        decode_hops.append(first_token_seconds(servers["decode"], prompt, 2, params))
        prefill_hops.append(seconds)
        pulls.append(servers["decode"].metric("kvferry:kv_transfer_seconds_sum") - pulled_before)
    pd = [a + b for a, b in zip(prefill_hops, decode_hops)]
    if servers["decode"].metric("kvferry:kv_transfer_fallbacks_total"):
        raise RuntimeError("a pull failed and was recomputed: the figures would not be P/D's")
    median = statistics.median
    return {
        "prompt_tokens": len(prompts[0]), "num_prompts": n,
        "colocated_ttft_s": median(colocated), "pd_ttft_s": median(pd),
        "prefill_hop_s": median(prefill_hops), "decode_hop_ttft_s": median(decode_hops),
        "pull_s": median(pulls), "transfer_share": median(pulls) / median(pd),
    }


if __name__ == "__main__":
    main()
