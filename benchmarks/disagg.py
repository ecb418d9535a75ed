"""Disaggregated prefill/decode against colocation: inter-token latency under long prompts.

Two services run side by side through `kvferry up`, on the demo model, with the same number
of engine pods:

- colocated: one pool of 2 `both` pods; the router spreads requests over them (least-loaded)
  and each pod prefills and decodes its own requests;
- disaggregated: 1 prefill pod and 1 decode pod; every prompt is longer than the router's
  prefill threshold (256 tokens), so it is computed on the prefill pod (max_tokens 1) and
  the decode pod pulls its KV blocks over NIXL and decodes.

Workload, the same for both: at each of `--rates`, `--num-requests` prompts of random token
ids (lengths uniform in `--input-len`), outputs uniform in `--output-len` (greedy, EOS
ignored, so every request produces exactly its tokens), sent with the same seeded Poisson
arrivals. Each rate has prompts of its own (the pods cache prefixes; a repeat would skip its
prefill). Every request streams through the router with httpx (server-sent events); the
client records the time to the first event (TTFT) and the gaps between events (ITL, pooled
over all requests). The server sends no event for a token that adds no text yet (held by
the detokenizer), so a few percent of the gaps span two tokens, the same in both services.
Two warm-up requests per service come first.

Why disaggregation should win: a colocated pod that admits a 1,000-2,000-token prompt runs
it in one engine step (the engine's default budget of 2,048 tokens per step, chunked
prefill on, is left as is in both services), and each request it is decoding waits for that
step: the ITL tail is a long prefill. A decode pod never runs one. The figure is `ratio` =
p99 ITL disaggregated / p99 ITL colocated at the highest rate (target <= 0.5). How often a
decode gap holds a prefill is about (requests decoding on the pod when a prompt arrives) /
(tokens per output), so p99 sees the stalls only once a pod decodes more than about one
request at a time: at 1 req/s on the demo model (a 96-token answer takes about a second)
it usually does not, and the ratio there says little. Hence a sweep of rates, and the
share of gaps longer than `--long-gap-ms` (100 ms, about the shortest prefill of these
prompts here), which counts the stalls whatever the percentile. The TTFT
columns show the other side of the trade: one prefill pod has half the prefill capacity of
two colocated pods.

Fairness on a small shared machine:
- Threads: every process `kvferry up` starts inherits OMP_NUM_THREADS=MKL_NUM_THREADS=
  `--threads` (1 by default), so each engine pod computes with one thread in both services:
  2 engine threads in all, one per core of a 2-core host, as one core per pod would be on a
  cluster. At torch's default (a thread per core) two pods would run 4 threads on 2 cores.
  Cores are not pinned (`kvferry up` has no such setting), and the HTTP front ends, the
  router, Redis and this client float over the same cores in both services.
- Time: both services are up at once (the idle one costs little) and each rate runs through
  one and then at once the other, in alternating order, because what other users run on
  the machine drifts. Per load the script prints each component's CPU seconds, the
  thread-seconds it spent waiting for a core, and the CPU seconds of every other process
  on the machine (the idle service included), so contention can be judged from the output.
- Engine flags: the operator's defaults in both services (block size 16, prefix caching
  on, `--max-model-len` from this script, no extra arguments).

    python benchmarks/disagg.py [--num-requests 48] [--rates 1,2,3] [--input-len 1000,2000]
        [--output-len 64,128] [--threads 1] [--plot benchmarks/out/disagg.png]

Also printed per load: where the time went (means of the router's hop latencies and of the
pods' queue time, engine TTFT and KV pull time). The last line is one JSON object. Every
process started is stopped at the end, on an error or on Ctrl-C or SIGTERM (SIGTERM to each
`kvferry up`, then SIGKILL to whatever of it is left, orphans of a dead `kvferry up` too).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from local_service import (
    LocalService,
    cpu_seconds,
    machine_busy_seconds,
    metric_sum,
    run_queue_wait_seconds,
)
from serving_load import (
    Request,
    RequestResult,
    percentiles_ms,
    run_load,
    synthetic_workload,
)

TARGET_RATIO = 0.5
DEMO_VOCAB_SIZE = 2048  # token ids of random prompts stay below it
CONFIGS: dict[str, dict[str, Any]] = {
    "colocated": {"decode": {"replicas": 2}},  # no prefill pool: the pods run `--role both`
    "disaggregated": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
}


# ---- per-request timing --------------------------------------------------------------------


def result_from_times(start: float, event_times: list[float], end: float,
                      num_tokens: int) -> RequestResult:
    """A request's latencies from when it was sent and when each streamed event arrived:
    TTFT is the wait for the first event, ITL the gaps between consecutive events."""
    if not event_times:
        return RequestResult(False, error="no tokens streamed")
    return RequestResult(True, num_output_tokens=num_tokens, ttft_s=event_times[0] - start,
                         e2e_s=end - start, inter_token_s=np.diff(event_times).tolist())


async def stream_completion(client: httpx.AsyncClient, model: str,
                            request: Request) -> RequestResult:
    """One streamed /v1/completions, timed per server-sent event."""
    body = {"model": model, "prompt": request.prompt_token_ids,
            "max_tokens": request.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    event_times: list[float] = []
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread())[:200]
                return RequestResult(False, error=f"HTTP {response.status_code}: {detail!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue  # blank separators and the closing [DONE]
                now = time.perf_counter()
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    return RequestResult(False, error=str(event["error"])[:200])
                event_times.append(now)
    except (httpx.HTTPError, ValueError) as exc:
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    return result_from_times(start, event_times, time.perf_counter(), request.max_tokens)


async def send_workload(url: str, model: str, workload: list[Request], rate: float,
                        seed: int) -> tuple[list[RequestResult], float]:
    """The workload at `rate` (Poisson; inf: all at once), each request on its own
    connection, so nothing queues in the client."""
    timeout = httpx.Timeout(600.0, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits,
                                 trust_env=False) as client:

        async def send(request: Request) -> RequestResult:
            return await stream_completion(client, model, request)

        return await run_load(url, workload, rate, None, seed, send)


# ---- what a load cost ----------------------------------------------------------------------


# Histograms whose means explain a TTFT: (label, metric, label filter) of the router's, and
# (label, metric) of each pod's.
ROUTER_TIMES = (("prefill hop", "kvferry:router_hop_latency_seconds", 'hop="prefill"'),
                ("decode hop to headers", "kvferry:router_hop_latency_seconds", 'hop="decode"'))
POD_TIMES = (("queue", "vllm:request_queue_time_seconds"),
             ("engine TTFT", "vllm:time_to_first_token_seconds"),
             ("KV pull", "kvferry:kv_transfer_seconds"))


@dataclass
class Reading:
    """A running service's counters at one moment; two readings give what a load cost."""

    cpu_s: dict[str, float]  # component (pod, router, redis, client, ...) -> CPU seconds
    wait_s: dict[str, float]  # component -> thread-seconds spent waiting for a core
    histograms: dict[str, tuple[float, float]]  # label -> (sum, count), see *_TIMES
    prefill_hops: float  # the router's successful prefill hops
    kv_fallbacks: float  # pulls that failed and were recomputed on a decode pod

    def since(self, before: Reading) -> Reading:
        """The growth of every counter from `before` to this reading."""
        histograms = {k: (s - before.histograms[k][0], n - before.histograms[k][1])
                      for k, (s, n) in self.histograms.items()}
        return Reading({k: round(v - before.cpu_s[k], 2) for k, v in self.cpu_s.items()},
                       {k: round(v - before.wait_s[k], 2) for k, v in self.wait_s.items()},
                       histograms, self.prefill_hops - before.prefill_hops,
                       self.kv_fallbacks - before.kv_fallbacks)

    def mean_ms(self) -> dict[str, float]:
        return {k: round(s / n * 1000.0, 2) for k, (s, n) in self.histograms.items() if n > 0}


def read_service(service: LocalService, components: dict[str, list[int]]) -> Reading:
    cpu = {c: cpu_seconds(pids) for c, pids in components.items()}
    cpu["client"] = sum(os.times()[:2])
    cpu["machine"] = machine_busy_seconds()
    router = service.metrics()
    histograms = {label: (metric_sum(router, name + "_sum", labels),
                          metric_sum(router, name + "_count", labels))
                  for label, name, labels in ROUTER_TIMES}
    fallbacks = 0.0
    for pod, url in service.pods.items():
        text = service.metrics(url)
        fallbacks += metric_sum(text, "kvferry:kv_transfer_fallbacks_total")
        for label, name in POD_TIMES:
            histograms[f"{pod} {label}"] = (metric_sum(text, name + "_sum"),
                                            metric_sum(text, name + "_count"))
    return Reading(cpu, {c: run_queue_wait_seconds(pids) for c, pids in components.items()},
                   histograms, metric_sum(router, "kvferry:router_hop_requests_total",
                                          'hop="prefill",outcome="200"'), fallbacks)


# ---- one service at one rate ---------------------------------------------------------------


@dataclass
class LoadRun:
    """What one service did with one rate's workload."""

    config: str
    rate: float
    results: list[RequestResult]
    duration_s: float
    cost: Reading  # the counters' growth during the load

    @property
    def done(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    def itl_s(self) -> list[float]:
        return [gap for r in self.done for gap in r.inter_token_s]

    def ttft_s(self) -> list[float]:
        return [r.ttft_s for r in self.done]

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds per component; "other processes": what else ran on the machine."""
        cpu = dict(self.cost.cpu_s)
        machine = cpu.pop("machine")
        return cpu | {"other processes": round(machine - sum(cpu.values()), 2)}

    def summary(self, long_gap_ms: float) -> dict[str, Any]:
        done = self.done
        num_tokens = sum(r.num_output_tokens for r in done)
        itl = self.itl_s()
        return {
            "ttft_ms": percentiles_ms(self.ttft_s()),
            "itl_ms": percentiles_ms(itl),
            # Gaps as long as a prefill of this workload's prompts: the stalls themselves.
            "itl_long_gap_percent": round(100.0 * sum(g * 1000.0 > long_gap_ms for g in itl)
                                          / max(1, len(itl)), 2),
            "e2e_ms": percentiles_ms([r.e2e_s for r in done]),
            "num_failed": len(self.results) - len(done),
            "output_tokens_per_s": round(num_tokens / self.duration_s, 2),
            # Below 1: a token that adds no text yet (held by the detokenizer) is not sent.
            "events_per_token": round(sum(len(r.inter_token_s) + 1 for r in done)
                                      / max(1, num_tokens), 4),
            "duration_s": round(self.duration_s, 2),
            "cpu_s": self.cpu_s(),
            "run_queue_wait_s": self.cost.wait_s,
            "prefill_hops": self.cost.prefill_hops,
            "kv_transfer_fallbacks": self.cost.kv_fallbacks,
            "mean_ms": self.cost.mean_ms(),
        }


def measure(service: LocalService, workload: list[Request], rate: float,
            seed: int) -> LoadRun:
    components = service.components()
    before = read_service(service, components)
    results, duration = asyncio.run(send_workload(service.url, service.name, workload, rate,
                                                  seed))
    cost = read_service(service, components).since(before)
    return LoadRun(service.name, rate, results, duration, cost)


def start_services(args: argparse.Namespace, warmup: list[Request], workdir: Path,
                   env: dict[str, str], stack: contextlib.ExitStack) -> dict[str, LocalService]:
    """Both configurations up at once (they start in parallel) and warmed up; `stack` stops
    them, whatever happens."""
    services = {}
    for name, pools in CONFIGS.items():
        service = LocalService(service_manifest(name, pools, args.max_model_len), workdir, env)
        stack.callback(stop_service, service)
        services[name] = service
    started = time.monotonic()
    for name, service in services.items():
        service.wait_ready(args.startup_timeout)
        print(f"{name}: ready after {time.monotonic() - started:.0f} s, pods "
              f"{', '.join(sorted(service.pods))}", flush=True)
        asyncio.run(send_workload(service.url, name, warmup, float("inf"), args.seed))
    return services


def stop_service(service: LocalService) -> None:
    killed = service.stop()
    if killed:
        print(f"{service.name}: killed {len(killed)} process(es) left after kvferry up stopped")


def run_rates(services: dict[str, LocalService], workloads: dict[float, list[Request]],
              seed: int) -> dict[float, dict[str, LoadRun]]:
    """Each rate's workload through one service, then straight away the other: the load that
    others put on a shared machine drifts, and runs close in time see about the same. The
    order alternates from rate to rate, so neither service always goes first."""
    by_rate: dict[float, dict[str, LoadRun]] = {}
    for i, (rate, workload) in enumerate(workloads.items()):
        names = list(services) if i % 2 == 0 else list(reversed(services))
        by_rate[rate] = {}
        for name in names:
            run = measure(services[name], workload, rate, seed)
            by_rate[rate][name] = run
            print(f"{name} at {rate:g} req/s: {len(run.done)}/{len(workload)} done in "
                  f"{run.duration_s:.0f} s", flush=True)
        by_rate[rate] = {name: by_rate[rate][name] for name in CONFIGS}  # table order
    return by_rate


def service_manifest(name: str, pools: dict[str, Any], max_model_len: int) -> dict[str, Any]:
    return {
        "apiVersion": "kvferry.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": {"source": "demo", "dtype": "float32", "maxModelLen": max_model_len},
            "engine": {"blockSize": 16},
            "pools": pools,
            "router": {"routing": {"decode": "least-loaded"}},
        },
    }


# ---- report --------------------------------------------------------------------------------


def print_rate(rate: float, runs: dict[str, LoadRun], long_gap_ms: float) -> None:
    """One rate's figures, the services side by side, and where their time and CPU went."""
    summaries = {name: run.summary(long_gap_ms) for name, run in runs.items()}
    print(f"\n--- {rate:g} req/s, {len(next(iter(runs.values())).results)} requests")
    print(f"{'':<22}" + "".join(f"{name:>16}" for name in runs))
    for label, key, p in (("TTFT p50 (ms)", "ttft_ms", "p50"), ("TTFT p99 (ms)", "ttft_ms", "p99"),
                          ("ITL p50 (ms)", "itl_ms", "p50"), ("ITL p99 (ms)", "itl_ms", "p99"),
                          ("e2e p50 (ms)", "e2e_ms", "p50")):
        print(f"{label:<22}" + "".join(f"{s[key][p]:>16.1f}" for s in summaries.values()))
    for label, key in ((f"ITL gaps > {long_gap_ms:g} ms (%)", "itl_long_gap_percent"),
                       ("output tokens/s", "output_tokens_per_s"), ("failed", "num_failed"),
                       ("events per token", "events_per_token"),
                       ("prefill hops", "prefill_hops"),
                       ("KV pull fallbacks", "kv_transfer_fallbacks")):
        print(f"{label:<22}" + "".join(f"{s[key]:>16}" for s in summaries.values()))
    for name, s in summaries.items():
        print(f"{name}: CPU s in {s['duration_s']} s on {os.cpu_count()} cores: "
              + _items(s["cpu_s"]))
        print(f"{name}: thread-s waiting for a core: " + _items(s["run_queue_wait_s"]))
        print(f"{name}: mean ms: " + _items(s["mean_ms"]))
    for run in runs.values():
        for failure in [r.error for r in run.results if not r.ok][:3]:
            print(f"{run.config}: a request failed: {failure}")


def _items(values: dict[str, float]) -> str:
    return ", ".join(f"{k} {v}" for k, v in values.items())


def plot(by_rate: dict[float, dict[str, LoadRun]], path: Path) -> None:
    """Per rate (a row), the ITL and TTFT distributions of both services side by side, as
    empirical CDFs on a log axis (the tail is the point), the p99 of each marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(by_rate), 2, figsize=(13, 4.2 * len(by_rate)), squeeze=False)
    for row, (rate, runs) in zip(axes, by_rate.items()):
        for ax, (title, values_of) in zip(row, (("inter-token latency", LoadRun.itl_s),
                                                ("time to first token", LoadRun.ttft_s))):
            for color, run in zip(("tab:red", "tab:blue"), runs.values()):
                values = np.sort(np.asarray(values_of(run)) * 1000.0)
                if values.size == 0:
                    continue
                p99 = float(np.percentile(values, 99))
                values = np.maximum(values, 0.01)  # events that came together: 0 ms
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post",
                        color=color, label=f"{run.config} (p99 {p99:.0f} ms, n={values.size})")
                ax.axvline(max(p99, 0.01), color=color, linestyle="--", linewidth=1)
            ax.set_xscale("log")
            ax.set_xlabel("ms")
            ax.set_ylabel("fraction of samples <= x")
            ax.set_title(f"{title}, {rate:g} req/s")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(loc="lower right")
    fig.suptitle("kvferry up: 2 colocated pods against 1 prefill + 1 decode pod")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def p99_itl_ratio(runs: dict[str, LoadRun]) -> float:
    return (percentiles_ms(runs["disaggregated"].itl_s())["p99"]
            / percentiles_ms(runs["colocated"].itl_s())["p99"])


def report(by_rate: dict[float, dict[str, LoadRun]], args: argparse.Namespace) -> dict[str, Any]:
    """The JSON figures: the headline at the highest rate, and every rate's in full."""
    rate = max(by_rate)
    headline = {name: run.summary(args.long_gap_ms) for name, run in by_rate[rate].items()}
    return {
        "ratio": round(p99_itl_ratio(by_rate[rate]), 4),
        "target": TARGET_RATIO,
        "rate": rate,
        "itl_p50_ms": {n: s["itl_ms"]["p50"] for n, s in headline.items()},
        "itl_p99_ms": {n: s["itl_ms"]["p99"] for n, s in headline.items()},
        "ttft_p50_ms": {n: s["ttft_ms"]["p50"] for n, s in headline.items()},
        "ttft_p99_ms": {n: s["ttft_ms"]["p99"] for n, s in headline.items()},
        "itl_long_gap_percent": {n: s["itl_long_gap_percent"] for n, s in headline.items()},
        "ratio_by_rate": {f"{r:g}": round(p99_itl_ratio(runs), 4)
                          for r, runs in by_rate.items()},
        "num_requests": args.num_requests, "input_len": args.input_len,
        "output_len": args.output_len, "threads": args.threads,
        "long_gap_ms": args.long_gap_ms,
        "num_failed": sum(len(run.results) - len(run.done)
                          for runs in by_rate.values() for run in runs.values()),
        "by_rate": {f"{r:g}": {n: run.summary(args.long_gap_ms) for n, run in runs.items()}
                    for r, runs in by_rate.items()},
    }


# ---- main ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=48, help="requests per rate")
    parser.add_argument("--rates", default="1,2,3",
                        help="comma-separated mean request rates (req/s) of the Poisson "
                             "arrivals; the highest gives the headline ratio")
    parser.add_argument("--input-len", default="1000,2000", help="MIN,MAX prompt tokens")
    parser.add_argument("--output-len", default="64,128", help="MIN,MAX output tokens")
    parser.add_argument("--threads", type=int, default=1,
                        help="OMP_NUM_THREADS of every process kvferry up starts")
    parser.add_argument("--long-gap-ms", type=float, default=100.0,
                        help="an ITL gap longer than this counts as a stall (about the "
                             "shortest prefill of the workload on the demo model)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--num-warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=600.0, metavar="S")
    parser.add_argument("--plot", type=Path, default=Path(__file__).parent / "out" / "disagg.png")
    args = parser.parse_args(argv)
    try:
        input_len, output_len = _pair(args.input_len), _pair(args.output_len)
        args.rate_list = sorted({float(x) for x in args.rates.split(",")})
    except ValueError as exc:
        parser.error(f"bad --input-len, --output-len or --rates: {exc}")
    if not 0 < input_len[0] <= input_len[1] or not 0 < output_len[0] <= output_len[1]:
        parser.error("--input-len and --output-len must be MIN,MAX with 0 < MIN <= MAX")
    if input_len[1] + output_len[1] > args.max_model_len:
        parser.error(f"the longest prompt and output ({input_len[1]} + {output_len[1]}) must "
                     f"fit --max-model-len {args.max_model_len}")
    if args.num_requests < 1 or args.threads < 1 or not all(r > 0 for r in args.rate_list):
        parser.error("--num-requests, --threads and every rate must be positive")
    return args


def _pair(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    return low, high


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds like Ctrl-C, so the services are stopped


def workloads_by_rate(args: argparse.Namespace) -> dict[float, list[Request]]:
    """Fresh prompts for every rate (the pods cache prefixes, and a repeat would skip its
    prefill); the same ones, at the same arrival times, for both services."""
    return {rate: synthetic_workload(args.num_requests, DEMO_VOCAB_SIZE, _pair(args.input_len),
                                     _pair(args.output_len), args.seed + 1 + i)
            for i, rate in enumerate(args.rate_list)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    workloads = workloads_by_rate(args)
    warmup = synthetic_workload(args.num_warmup, DEMO_VOCAB_SIZE, _pair(args.input_len),
                                (8, 8), args.seed)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "MKL_NUM_THREADS": str(args.threads)}
    with (tempfile.TemporaryDirectory(prefix="kvferry-disagg-") as tmp,
          contextlib.ExitStack() as stack):
        services = start_services(args, warmup, Path(tmp), env, stack)
        by_rate = run_rates(services, workloads, args.seed)
    for rate, runs in by_rate.items():
        print_rate(rate, runs, args.long_gap_ms)
    plot(by_rate, args.plot)
    figures = report(by_rate, args)
    print(f"\nwrote {args.plot}")
    print("p99 ITL disaggregated / colocated: "
          + ", ".join(f"{r} req/s {v:.3f}" for r, v in figures["ratio_by_rate"].items())
          + f" (target <= {TARGET_RATIO} at {figures['rate']:g} req/s: {figures['ratio']:.3f})")
    print(json.dumps(figures))
    return 0 if figures["num_failed"] == 0 else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("disagg.py: interrupted; every process it started is stopped", file=sys.stderr)
        sys.exit(130)
