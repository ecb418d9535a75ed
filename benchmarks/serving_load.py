"""The load generator of benchmarks/serving.py (and benchmarks/disagg.py): synthetic
prompts, a lean streaming HTTP client, Poisson or fixed-concurrency arrivals, per-request
latencies, their percentiles, and the latency plot."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
FIRST_NORMAL_TOKEN = 4  # ids below are specials in the generated and demo tokenizers

@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class RequestResult:
    """What the client saw of one request."""

    ok: bool
    num_output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    inter_token_s: list[float] = field(default_factory=list)
    error: str = ""


@dataclass
class RunSummary:
    """One load level."""

    request_rate: float
    max_concurrency: int | None
    num_requests: int
    num_failed: int
    duration_s: float
    request_throughput: float
    output_tokens_per_s: float
    ttft_ms: dict[str, float]
    inter_token_ms: dict[str, float]
    e2e_ms: dict[str, float]


def synthetic_workload(num_requests: int, vocab_size: int, input_range: tuple[int, int],
                       output_range: tuple[int, int], seed: int) -> list[Request]:
    """Random prompt token ids; prompt and output lengths uniform in the inclusive ranges."""
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(num_requests):
        num_prompt = int(rng.integers(input_range[0], input_range[1] + 1))
        prompt = rng.integers(FIRST_NORMAL_TOKEN, vocab_size, size=num_prompt).tolist()
        requests.append(Request(prompt, int(rng.integers(output_range[0], output_range[1] + 1))))
    return requests


# ---- the load generator --------------------------------------------------------------------


class StreamClient:
    """A minimal HTTP/1.1 streaming client: one connection per request, chunked SSE read as
    bytes. The load generator shares the machine with the server, so it must cost little
    per token (a general-purpose client spends more per chunk than the server does)."""

    def __init__(self, url: str) -> None:
        host_port = url.removeprefix("http://").rstrip("/")
        self.host, port = host_port.rsplit(":", 1)
        self.port = int(port)

    async def post_stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[tuple[int, bytes]]:
        """Yields (status, chunk bytes) of the response body as it arrives."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            payload = json.dumps(body).encode()
            writer.write(
                f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json"
                f"\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                + payload)
            status, chunked = await _read_head(reader)
            if not chunked:
                yield status, await reader.read()
                return
            while True:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    return
                yield status, (await reader.readexactly(size + 2))[:-2]
        finally:
            writer.close()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, bool]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    chunked = any(line.lower().startswith("transfer-encoding:") and "chunked" in line.lower()
                  for line in lines[1:])
    return status, chunked


async def send_request(client: StreamClient, request: Request) -> RequestResult:
    body = {"prompt": request.prompt_token_ids, "max_tokens": request.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    token_times: list[float] = []
    pending = b""
    try:
        async for status, data in client.post_stream("/v1/completions", body):
            if status != 200:
                return RequestResult(False, error=f"HTTP {status}: {data[:200]!r}")
            now = time.perf_counter()
            events = (pending + data).split(b"\n\n")
            pending = events.pop()  # an event not yet complete
            for event in events:
                if event.startswith(b"data: {"):
                    if b'"error"' in event:
                        return RequestResult(False, error=event[:200].decode())
                    token_times.append(now)
    except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    if not token_times:
        return RequestResult(False, error="no tokens")
    end = time.perf_counter()
    # One chunk per step; a chunk can carry more than one token, so count the request's own.
    return RequestResult(True, num_output_tokens=request.max_tokens,
                         ttft_s=token_times[0] - start, e2e_s=end - start,
                         inter_token_s=list(np.diff(token_times)))


Send = Callable[[Request], Awaitable[RequestResult]]


async def run_load(url: str, workload: list[Request], rate: float, max_concurrency: int | None,
                   seed: int, send: Send | None = None) -> tuple[list[RequestResult], float]:
    """Sends the workload with Poisson arrivals at `rate` (inf: all at once), each request
    by `send` (default: the lean client's `send_request` to `url`)."""
    rng = np.random.default_rng(seed)
    limit = asyncio.Semaphore(max_concurrency or len(workload))
    if send is None:
        client = StreamClient(url)

        async def send(request: Request) -> RequestResult:
            return await send_request(client, request)

    async def limited(request: Request) -> RequestResult:
        async with limit:
            return await send(request)

    tasks = []
    start = time.perf_counter()
    for request in workload:
        tasks.append(asyncio.create_task(limited(request)))
        if rate != float("inf"):
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def percentiles_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {f"p{p}": float("nan") for p in PERCENTILES} | {"mean": float("nan")}
    array = np.asarray(values) * 1000.0
    out = {f"p{p}": round(float(np.percentile(array, p)), 3) for p in PERCENTILES}
    return out | {"mean": round(float(array.mean()), 3)}


def summarize(results: list[RequestResult], duration_s: float, rate: float,
              max_concurrency: int | None) -> RunSummary:
    done = [r for r in results if r.ok]
    num_tokens = sum(r.num_output_tokens for r in done)
    return RunSummary(
        request_rate=rate, max_concurrency=max_concurrency, num_requests=len(results),
        num_failed=len(results) - len(done), duration_s=round(duration_s, 3),
        request_throughput=round(len(done) / duration_s, 3),
        output_tokens_per_s=round(num_tokens / duration_s, 2),
        ttft_ms=percentiles_ms([r.ttft_s for r in done]),
        inter_token_ms=percentiles_ms([t for r in done for t in r.inter_token_s]),
        e2e_ms=percentiles_ms([r.e2e_s for r in done]),
    )


def print_summary(summary: RunSummary) -> None:
    rate = "inf" if summary.request_rate == float("inf") else f"{summary.request_rate:g}"
    print(f"rate {rate:>5} req/s: {summary.request_throughput:7.2f} req/s, "
          f"{summary.output_tokens_per_s:9.1f} tok/s, failed {summary.num_failed}, "
          f"TTFT p50/p99 {summary.ttft_ms['p50']:.1f}/{summary.ttft_ms['p99']:.1f} ms, "
          f"ITL p50/p99 {summary.inter_token_ms['p50']:.1f}/{summary.inter_token_ms['p99']:.1f} ms, "
          f"e2e p50/p99 {summary.e2e_ms['p50']:.0f}/{summary.e2e_ms['p99']:.0f} ms", flush=True)


def plot(summaries: list[RunSummary], path: Path) -> None:
    """Latency percentiles against the achieved request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s.request_throughput for s in summaries]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, title in zip(axes, ("ttft_ms", "inter_token_ms", "e2e_ms"),
                              ("time to first token", "inter-token latency", "end-to-end")):
        for p in ("p50", "p90", "p99"):
            ax.plot(x, [getattr(s, key)[p] for s in summaries], marker="o", label=p)
        ax.set_xlabel("request throughput (req/s)")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("kvferry serve: latency against request rate")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def jsonable(summary: RunSummary) -> dict[str, Any]:
    """JSON has no infinity: an unbounded rate is written "inf"."""
    out = asdict(summary)
    if summary.request_rate == float("inf"):
        out["request_rate"] = "inf"
    return out


def summary_of(run: dict[str, Any]) -> RunSummary:
    return RunSummary(**{**run, "request_rate": float(run["request_rate"])})
